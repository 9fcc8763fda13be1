"""Why the model service refuses or ends a request: one class per gRPC status code, each message
written for a person. The servicer's table (model_service/status.py) gives each its code; nothing
else picks a code, and no message carries a Python repr.
"""

from __future__ import annotations

import uuid


class RequestFailed(Exception):
    """The request was refused or could not be completed; str() is the message the client reads."""


class InvalidRequest(RequestFailed, ValueError):
    """Bad input: the request can never be served as sent."""


# The trailing metadata key a refused continuation carries (NothingToGenerate): the name of the
# FinishReason its tokens already reached, so that a gateway whose worker died between a
# sequence's last token and its end can end the stream as it would have ended.
ENDED_TRAILER = "kvserve-already-ended"
# Beside it, where a stop ended the tokens, which one, as Finished.stop and .stop_token_id say it:
# the index of the stop string among the request's own (short, and ASCII, as metadata must be),
# or the stop token id (EOS included).
ENDED_STOP_TRAILER = "kvserve-already-ended-stop"
ENDED_STOP_TOKEN_TRAILER = "kvserve-already-ended-stop-token"


class NothingToGenerate(InvalidRequest):
    """A continuation (GenerateRequest.continuation) whose tokens already end the sequence."""

    def __init__(self, message: str, finish_reason: str, stop_index: int | None = None,
                 stop_token_id: int | None = None) -> None:
        super().__init__(message)
        self.finish_reason = finish_reason   # a FinishReason name: FINISH_REASON_LENGTH, _STOP
        self.stop_index, self.stop_token_id = stop_index, stop_token_id

    def trailers(self) -> tuple[tuple[str, str], ...]:
        out = [(ENDED_TRAILER, self.finish_reason)]
        if self.stop_index is not None:
            out.append((ENDED_STOP_TRAILER, str(self.stop_index)))
        if self.stop_token_id is not None:
            out.append((ENDED_STOP_TOKEN_TRAILER, str(self.stop_token_id)))
        return tuple(out)


class QueueFull(RequestFailed):
    """More requests wait than --max-waiting allows (or a tokenizer lane's): try again later,
    in about retry_after_ms (sent as the retry-after-ms trailer, Retry-After over HTTP)."""

    retry_after_ms = 1000


# The response header a worker sends as it takes a Generate in (its engine has the request, queued
# or running). A gateway tells by it a worker that failed with the request taken from one that
# refused it before (draining, its port closed), which a response of trailers alone cannot say.
TAKEN_HEADER = "kvserve-taken"

# Trailing metadata on a status that is the request's own although its code says "try another
# server" (RESOURCE_EXHAUSTED): a gateway passes it on instead of moving the request.
FINAL_TRAILER = "kvserve-final"


class ClientTooSlow(QueueFull):
    """The stream's client left more tokens unread than --max-unread-tokens."""


class DuplicateRequest(RequestFailed):
    """A request with this id is already in flight."""


class Unauthenticated(RequestFailed):
    """No API key, or one the server does not know."""


class Unavailable(RequestFailed):
    """This worker cannot serve now (its KV-cache manager is unreachable, it is draining or
    shutting down); another worker, or this one later, can."""


class InternalError(RequestFailed):
    """A bug. The message names an incident id that the server's log has beside the traceback."""

    def __init__(self, what: str) -> None:
        self.incident = uuid.uuid4().hex[:12]
        super().__init__(f"internal error ({what}); the server log has the details under incident "
                         f"{self.incident}")
