"""The limits on a request's identifiers, one rule for a worker and for a gateway in front of it
(which refuses before routing what the worker would refuse after)."""

from __future__ import annotations

MAX_REQUEST_ID_CHARS = 256
MAX_SESSION_ID_CHARS = 256   # the gateway remembers each session's worker
# A request whose id a cancelled one still holds waits for it to end (within a step) this long at
# most, then is refused ALREADY_EXISTS: a client that cancelled and sends the id again is served.
CANCELLED_ID_WAIT_S = 5.0
# A call whose client left a moment ago holds its id until its handler unwinds: a loop turn when
# it waited for a token, a few when it was writing one (its generator is closed by a task of its
# own). A request sent again under that id waits this long for it before ALREADY_EXISTS, which
# a true duplicate gets this much later.
LEFT_CALL_WAIT_S = 0.05


def id_problem(request_id: str, session_id: str = "") -> str | None:
    """Why these ids are refused, or None."""
    if len(request_id) > MAX_REQUEST_ID_CHARS:
        return f"the request id has {len(request_id)} characters; at most {MAX_REQUEST_ID_CHARS} are allowed"
    if not request_id.isprintable():   # control characters separate the ids the engine derives
        return "the request id contains control characters"
    if len(session_id) > MAX_SESSION_ID_CHARS:
        return f"the session id has {len(session_id)} characters; at most {MAX_SESSION_ID_CHARS} are allowed"
    return None
