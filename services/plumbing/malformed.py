"""Requests whose bytes are not the message they should be, refused with INVALID_ARGUMENT.

grpc parses a request before any handler or interceptor sees it, and a parse error becomes
UNKNOWN with the exception's class repr ("Unexpected <class '...DecodeError'>: ..."), logged
with a traceback at ERROR, so any client could fill the log. RefuseMalformed swaps every
method's parser for one that hands a MalformedRequest to the handler instead of raising, and
wraps the handler so that it ends such a call with INVALID_ARGUMENT and a sentence naming the
message it expected, before the servicer runs. Installed on every kvserve server
(grpc_server.create_server), innermost, so an interceptor that refuses a caller (auth.py)
still answers first.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Awaitable, Callable

import grpc
from google.protobuf.message import DecodeError

from kvserve.services.plumbing.handlers import like

Continuation = Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]]


class MalformedRequest:
    """What the parser hands on in place of a message it could not parse."""

    __slots__ = ("reason",)

    def __init__(self, reason: str) -> None:
        self.reason = reason


def expected_message(deserializer, method: str) -> str:
    """The full name of the message `deserializer` parses (a generated class's FromString),
    or the method's name where it cannot tell."""
    cls = getattr(deserializer, "__self__", None)
    descriptor = getattr(cls, "DESCRIPTOR", None)
    name = getattr(descriptor, "full_name", None)
    return name if isinstance(name, str) else f"request for {method}"


def tolerant(deserializer):
    def parse(raw: bytes):
        try:
            return deserializer(raw)
        except (DecodeError, UnicodeDecodeError) as exc:
            return MalformedRequest(str(exc))
    return parse


def _checked_requests(requests, context, message: str):
    async def each():
        async for request in requests:
            if isinstance(request, MalformedRequest):
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, message)
            yield request
    return each()


def _refusing(handler: grpc.RpcMethodHandler, message: str):
    """handler's behaviour, refusing a malformed request (or one in a request stream) first;
    None where the behaviour is not async (such handlers keep grpc's own parsing)."""
    behaviour = handler.unary_unary or handler.unary_stream or handler.stream_unary or handler.stream_stream
    streams_out = handler.response_streaming and inspect.isasyncgenfunction(behaviour)
    if not (streams_out or inspect.iscoroutinefunction(behaviour)):
        return None
    if handler.request_streaming:
        def arguments(requests, context):
            return _checked_requests(requests, context, message), context
    else:
        def arguments(request, context):
            return request, context

    async def first(request, context) -> None:
        if isinstance(request, MalformedRequest):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, message)

    if streams_out:
        async def stream(request, context):
            await first(request, context)
            # closed with this one: the handler's own finally runs as the call ends, not when collected
            async with contextlib.aclosing(behaviour(*arguments(request, context))) as responses:
                async for response in responses:
                    yield response
        return stream

    async def once(request, context):
        await first(request, context)
        return await behaviour(*arguments(request, context))
    return once


class RefuseMalformed(grpc.aio.ServerInterceptor):
    async def intercept_service(self, continuation: Continuation,
                                details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if handler is None or handler.request_deserializer is None:
            return handler
        name = expected_message(handler.request_deserializer, details.method)
        behaviour = _refusing(handler, f"the request is not a valid {name}: its bytes could not be parsed")
        if behaviour is None:
            return handler
        return like(handler, behaviour, tolerant(handler.request_deserializer))
