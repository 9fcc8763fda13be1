"""A handler's unexpected failure (a bug) told as INTERNAL with an incident id that the log has
beside the traceback, never grpc's UNKNOWN with the exception's repr ("Unexpected <class
'...'>: ..."). A peer's failed call that a handler let through is a bug too: its status spoke
of this server's call to the peer (and may name internal addresses), so handlers say what a
peer's failure means to their client themselves. grpc's own exceptions (an abort, a stopped
server, a client gone) and cancellation pass untouched. Installed on every kvserve server
(grpc_server.create_server), innermost: it wraps the servicer's own behaviour and nothing else."""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import uuid
from collections.abc import Awaitable, Callable

import grpc

from kvserve.services.plumbing.handlers import like

log = logging.getLogger(__name__)

Continuation = Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]]


def told_as_incident(method: str, exc: Exception) -> str:
    """Logs a bug with its traceback under a new incident id; the INTERNAL status's message."""
    incident = uuid.uuid4().hex[:12]
    log.error("%s failed (incident %s)", method, incident, exc_info=exc)
    return f"internal error in {method.rsplit('/', 1)[-1]}; the server log has the details under incident {incident}"


async def _told(context: grpc.aio.ServicerContext, method: str, exc: Exception) -> None:
    if getattr(context, "done", lambda: False)():   # ended already: nothing can be told
        raise exc
    await context.abort(grpc.StatusCode.INTERNAL, told_as_incident(method, exc))


def _guarded(handler: grpc.RpcMethodHandler, method: str):
    """handler's behaviour with its unexpected failures told; None where it is not async."""
    behaviour = handler.unary_unary or handler.unary_stream or handler.stream_unary or handler.stream_stream
    if handler.response_streaming and inspect.isasyncgenfunction(behaviour):
        async def stream(request, context):
            try:   # closed with this one: the handler's own finally runs as the call ends, not when collected
                async with contextlib.aclosing(behaviour(request, context)) as responses:
                    async for response in responses:
                        yield response
            except (grpc.aio.BaseError, asyncio.CancelledError):   # grpc's own (an abort among them), or a cancel
                raise
            except Exception as exc:
                await _told(context, method, exc)
        return stream
    if not inspect.iscoroutinefunction(behaviour):
        return None

    async def once(request, context):
        try:
            return await behaviour(request, context)
        except (grpc.aio.BaseError, asyncio.CancelledError):
            raise
        except Exception as exc:
            await _told(context, method, exc)
    return once


class HideUnexpected(grpc.aio.ServerInterceptor):
    async def intercept_service(self, continuation: Continuation,
                                details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if handler is None:
            return handler
        behaviour = _guarded(handler, details.method)
        return handler if behaviour is None else like(handler, behaviour)
