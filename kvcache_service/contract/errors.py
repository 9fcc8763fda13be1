"""Domain errors. The servicer maps each class to one gRPC status code, in one place."""


class KVCacheError(Exception):
    """Base class; a call that raises one has changed nothing."""


class InvalidArgument(KVCacheError):
    """A malformed request: a zero count, an empty token list, a page_size mismatch."""


class NotFound(KVCacheError):
    """An unknown seq id or request id."""


class AlreadyExists(KVCacheError):
    """Admitting a request id that is live."""


class ResourceExhausted(KVCacheError):
    """No seq id or page left (fine-grained calls; Step answers granted=false instead)."""


class FailedPrecondition(KVCacheError):
    """A stale epoch, or a sequence in the wrong state for the call."""


class ManagerUnavailable(KVCacheError):
    """The client's view: the manager did not answer (no connection, a broken stream, a
    deadline). The manager itself never raises it."""
