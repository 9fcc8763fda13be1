"""Calls to this process's own gRPC server without a socket: the HTTP front's way in.

A LocalChannel stands where a grpc.aio.Channel would (a generated stub takes it), but runs each
call's handler on the calling task, through the same interceptors, in the same order, as the
server runs them for a call from the network: API keys, tenants, refusals and status codes are
the server's own. What it leaves out is the HTTP/2 hop: a streamed message is handed over as
the object the handler yielded, not serialized, sent, received and parsed again (what that hop
cost the HTTP front per streamed token: docs/benchmarks.md, "The HTTP front without its hop").

What a call can see of its context: its metadata, its deadline, abort (the first status wins,
as in grpc), initial and trailing metadata (trailing comes back on the error), and the peer
"local". An error leaves as grpc.aio.AioRpcError; an exception a handler did not turn into a
status is UNKNOWN with a sentence (the traceback goes to the log), as grpc answers it.
Cancelling the call, or the task that reads it, closes the handler there and then.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any, NamedTuple

import grpc

log = logging.getLogger(__name__)

PEER = "local:"


class HandlerRecorder:
    """What a generated add_*_to_server registers, collected for a LocalChannel."""

    def __init__(self) -> None:
        self.handlers: list[grpc.GenericRpcHandler] = []

    def add_generic_rpc_handlers(self, handlers) -> None:
        self.handlers.extend(handlers)

    def add_registered_method_handlers(self, service, handlers) -> None:
        pass   # the generic handlers above answer the same methods


class _Details(NamedTuple):   # grpc.HandlerCallDetails
    method: str
    invocation_metadata: tuple


class _Aborted(grpc.aio.AbortError):
    """context.abort's exception, as grpc.aio's is (an Exception handlers may see pass)."""


class _Context:
    """The part of grpc.aio.ServicerContext kvserve's handlers use."""

    def __init__(self, metadata: tuple, timeout: float | None) -> None:
        self._metadata = metadata
        self._deadline = None if timeout is None else time.monotonic() + timeout
        self.code: grpc.StatusCode | None = None
        self.details = ""
        self.trailing: tuple = ()

    def invocation_metadata(self) -> tuple:
        return self._metadata

    def peer(self) -> str:
        return PEER

    def time_remaining(self) -> float | None:
        return None if self._deadline is None else max(0.0, self._deadline - time.monotonic())

    async def send_initial_metadata(self, metadata) -> None:
        pass

    def set_trailing_metadata(self, metadata) -> None:
        self.trailing = tuple(metadata)

    def set_code(self, code: grpc.StatusCode) -> None:
        self.code = code

    def set_details(self, details: str) -> None:
        self.details = details

    async def abort(self, code: grpc.StatusCode, details: str = "", trailing_metadata=()) -> None:
        if self.code is None:   # the first abort's status is the call's
            self.code, self.details = code, details
            if trailing_metadata:
                self.trailing = tuple(trailing_metadata)
        raise _Aborted()

    def error(self, exc: BaseException | None, method: str) -> grpc.aio.AioRpcError:
        """The status the call ends with, after `exc` (None: the handler returned)."""
        if self.code is None and exc is not None and not isinstance(exc, _Aborted):
            log.error("%s failed in this process", method, exc_info=exc)
            self.code, self.details = grpc.StatusCode.UNKNOWN, f"{method} failed: {type(exc).__name__}"
        return grpc.aio.AioRpcError(self.code or grpc.StatusCode.UNKNOWN, grpc.aio.Metadata(),
                                    grpc.aio.Metadata(*self.trailing), details=self.details)


def _deadline_exceeded() -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(grpc.StatusCode.DEADLINE_EXCEEDED, grpc.aio.Metadata(), grpc.aio.Metadata(),
                                details="Deadline Exceeded")


class _StreamCall:
    """A unary-stream call: iterate it for the responses; cancel() ends it where it stands."""

    def __init__(self, channel: LocalChannel, method: str, request, metadata: tuple, timeout: float | None) -> None:
        self._responses = channel._stream(method, request, metadata, timeout)
        self._cancelled = False

    def __aiter__(self) -> AsyncIterator:
        return self._responses

    async def read(self):
        try:
            return await anext(self._responses)
        except StopAsyncIteration:
            return grpc.aio.EOF

    def cancel(self) -> bool:
        """Closes the handler (its finally blocks run: a request's pages go back). A call that
        is being read now is cancelled by cancelling the task that reads it, as grpc's is."""
        if self._cancelled:
            return False
        self._cancelled = True
        if self._responses.ag_running:
            return True
        task = asyncio.ensure_future(self._responses.aclose())
        task.add_done_callback(_log_close_failure)
        return True


def _log_close_failure(task: asyncio.Task) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("closing a local call failed", exc_info=task.exception())


class LocalChannel:
    """A channel to this process's own server: `handlers` as create_server registered them,
    `interceptors` in the server's order (the first sees a call first). A method it has no
    handler for ends UNIMPLEMENTED."""

    def __init__(self, handlers: Sequence[grpc.GenericRpcHandler], interceptors: Sequence[Any]) -> None:
        self._handlers = list(handlers)
        self._interceptors = list(interceptors)

    def unary_unary(self, method: str, request_serializer=None, response_deserializer=None, **kw) -> Callable:
        async def call(request, timeout: float | None = None, metadata=None, **_):
            return await self._unary(method, request, tuple(metadata or ()), timeout)
        return call

    def unary_stream(self, method: str, request_serializer=None, response_deserializer=None, **kw) -> Callable:
        def call(request, timeout: float | None = None, metadata=None, **_):
            return _StreamCall(self, method, request, tuple(metadata or ()), timeout)
        return call

    async def close(self) -> None:
        pass   # no connection to close: a Channel's method, for who holds this as one

    async def _handler(self, method: str, metadata: tuple):
        async def lookup(details):
            for generic in self._handlers:
                handler = generic.service(details)
                if handler is not None:
                    return handler
            return None

        step = lookup
        for interceptor in reversed(self._interceptors):
            step = _chained(interceptor, step)
        return await step(_Details(method, metadata))

    def _missing(self, method: str) -> grpc.aio.AioRpcError:
        return grpc.aio.AioRpcError(grpc.StatusCode.UNIMPLEMENTED, grpc.aio.Metadata(), grpc.aio.Metadata(),
                                    details=f"{method} is not served here")

    async def _unary(self, method: str, request, metadata: tuple, timeout: float | None):
        handler = await self._handler(method, metadata)
        if handler is None or handler.unary_unary is None:
            raise self._missing(method)
        context = _Context(metadata, timeout)
        try:
            response = await asyncio.wait_for(handler.unary_unary(request, context), timeout)
        except asyncio.TimeoutError:
            raise _deadline_exceeded() from None
        except Exception as exc:
            raise context.error(exc, method) from None
        if context.code not in (None, grpc.StatusCode.OK):   # set_code without abort
            raise context.error(None, method)
        return response

    async def _stream(self, method: str, request, metadata: tuple, timeout: float | None) -> AsyncIterator:
        handler = await self._handler(method, metadata)
        if handler is None or handler.unary_stream is None:
            raise self._missing(method)
        context = _Context(metadata, timeout)
        responses = handler.unary_stream(request, context)
        try:
            while True:
                left = context.time_remaining()
                try:
                    if left is None:
                        response = await anext(responses)
                    else:
                        response = await asyncio.wait_for(anext(responses), left)
                except StopAsyncIteration:
                    break
                except asyncio.TimeoutError:
                    raise _deadline_exceeded() from None
                except Exception as exc:
                    raise context.error(exc, method) from None
                yield response
            if context.code not in (None, grpc.StatusCode.OK):
                raise context.error(None, method)
        finally:
            await responses.aclose()


def _chained(interceptor, continuation):
    async def step(details):
        return await interceptor.intercept_service(continuation, details)
    return step
