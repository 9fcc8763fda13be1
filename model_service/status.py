"""The model service's one error table: each RequestFailed class (engine/errors.py) and the gRPC
status code a call ends with. Anything else that escapes a handler is a bug: it is logged with
its traceback under an incident id, and the call ends INTERNAL naming that id, never with the
exception's repr."""

from __future__ import annotations

import logging
from typing import NoReturn

import grpc

from kvserve.kvcache_service.contract.errors import ManagerUnavailable
from kvserve.model_service.engine.errors import (
    DuplicateRequest,
    InternalError,
    FINAL_TRAILER,
    ClientTooSlow,
    InvalidRequest,
    NothingToGenerate,
    QueueFull,
    RequestFailed,
    Unauthenticated,
    Unavailable,
)

log = logging.getLogger(__name__)

STATUS_OF: dict[type[RequestFailed], grpc.StatusCode] = {
    InvalidRequest: grpc.StatusCode.INVALID_ARGUMENT,
    QueueFull: grpc.StatusCode.RESOURCE_EXHAUSTED,
    DuplicateRequest: grpc.StatusCode.ALREADY_EXISTS,
    Unavailable: grpc.StatusCode.UNAVAILABLE,
    Unauthenticated: grpc.StatusCode.UNAUTHENTICATED,
    InternalError: grpc.StatusCode.INTERNAL,
}


# The codes a refused Generate call ends with, as metrics' label values (a gateway's too).
REFUSAL_CODES = tuple(code.name for code in dict.fromkeys(STATUS_OF.values()))


def as_request_failed(exc: Exception, what: str, request_id: str = "") -> RequestFailed:
    """`exc` as the RequestFailed a client is told; an unexpected one is logged as a bug, with the
    request's id where it has one (as the client sent it: shown escaped)."""
    if isinstance(exc, RequestFailed):
        return exc
    of = f" (request {request_id!r})" if request_id else ""
    if isinstance(exc, ManagerUnavailable):   # its words name the manager's address: the log's alone
        log.warning("%s%s: %s", what, of, exc)
        return Unavailable("its KV-cache manager did not answer; this worker cannot serve until it does")
    error = InternalError(what)
    log.error("%s%s (incident %s)", what, of, error.incident, exc_info=exc)
    return error


# A status message travels in a header, which gRPC refuses past 16 KiB (the call then ends
# RESOURCE_EXHAUSTED, a code the gateway reads as a full worker); percent-encoded, a character
# may take 12 bytes.
MAX_STATUS_CHARS = 1000


def status_message(error: Exception) -> str:
    text = str(error)
    return text if len(text) <= MAX_STATUS_CHARS else text[:MAX_STATUS_CHARS - 1] + "…"


def status_code(error: RequestFailed) -> grpc.StatusCode:
    return next(code for cls, code in STATUS_OF.items() if isinstance(error, cls))


async def abort(context: grpc.aio.ServicerContext, error: RequestFailed) -> NoReturn:
    code = status_code(error)
    trailers = error.trailers() if isinstance(error, NothingToGenerate) else \
        ((FINAL_TRAILER, "1"),) if isinstance(error, ClientTooSlow) else \
        (("retry-after-ms", str(error.retry_after_ms)),) if isinstance(error, QueueFull) else ()
    await context.abort(code, status_message(error), trailers)
