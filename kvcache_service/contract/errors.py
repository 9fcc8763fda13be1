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


SHOWN_ID_CHARS = 200   # of a request id quoted in a message (shown)


def shown(request_id: str) -> str:
    """A request id quoted for a message, at most SHOWN_ID_CHARS: repr spells a character that is
    not printable in up to ten, and a status's message must fit in gRPC's headers."""
    quoted = repr(request_id)
    return quoted if len(quoted) <= SHOWN_ID_CHARS else quoted[:SHOWN_ID_CHARS - 2] + "…" + quoted[-1]
