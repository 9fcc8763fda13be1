"""The asyncio twin of InferenceClient (inference_client.py), on grpc.aio: the same methods,
options and results, awaited.

    from kvserve.clients.async_client import AsyncInferenceClient, Chunk

    async with AsyncInferenceClient("127.0.0.1:50051", api_key="KEY") as client:
        async for event in client.generate("Once upon a time", max_tokens=32, temperature=0):
            if isinstance(event, Chunk):
                print(event.text, end="", flush=True)
        print((await client.complete("hi")).text)

Make and use a client inside one running event loop (grpc.aio binds its channel to it).
Every failed call raises KVServeError, as the sync client does.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from typing import Any

import grpc

from kvserve.clients import convert
from kvserve.clients.connection import auth_metadata, channel_options, check_target, client_tls
from kvserve.clients.results import (
    Chunk,
    Completion,
    Event,
    Finished,
    KVCacheStats,
    KVServeError,
    Message,
    ModelInfo,
    PrefillDone,
    Queued,
    ServerStats,
    Tokenized,
    TokenLogprob,
    TopLogprob,
    WorkerStats,
)
from kvserve.inference.v1 import inference_pb2 as pb
from kvserve.inference.v1 import inference_pb2_grpc as pb_grpc
from kvserve.services.plumbing.tls import ClientTLS, aio_channel

__all__ = [   # the result types the sync module exports too
    "AsyncGenerateStream", "AsyncInferenceClient", "Chunk", "ClientTLS", "Completion", "Event", "Finished",
    "KVCacheStats", "KVServeError", "Message", "ModelInfo", "PrefillDone", "Queued", "ServerStats", "Tokenized",
    "TokenLogprob", "TopLogprob", "WorkerStats",
]


def _task_cancelled() -> bool:
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


class AsyncGenerateStream(AsyncIterator[Event]):
    """The events of one Generate call; `async for` over it. cancel() (or leaving an
    `async with` block) aborts the request on the server."""

    def __init__(self, call: Any, request_id: str = "") -> None:
        self._call = call
        self._cancelled = False
        self.request_id = request_id  # filled in from prefill_done when the server assigns it
        self.finished: Finished | None = None

    def __aiter__(self) -> AsyncGenerateStream:
        return self

    async def __anext__(self) -> Event:
        while True:
            try:
                msg = await self._call.read()
            except grpc.RpcError as exc:
                raise KVServeError.from_rpc_error(exc) from exc
            except asyncio.CancelledError:
                # grpc.aio reports a call cancelled here (by cancel(), or by the client closed
                # under it) as CancelledError; the sync client raises KVServeError CANCELLED. A
                # cancelled task still gets its CancelledError.
                if not _task_cancelled():
                    why = "by the client" if self._cancelled else "(its client was closed)"
                    raise KVServeError("CANCELLED", f"the call was cancelled {why}") from None
                raise
            if msg is grpc.aio.EOF:
                raise StopAsyncIteration
            event = convert.stream_event(self, msg)
            if event is not None:
                return event

    def cancel(self) -> None:
        """Abort the call; further iteration raises KVServeError("CANCELLED", ...)."""
        self._cancelled = True
        self._call.cancel()

    close = cancel

    async def __aenter__(self) -> AsyncGenerateStream:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.cancel()  # a no-op once the call has ended

    def __del__(self) -> None:
        """A stream dropped before its end (a `break`, then nothing holds it) aborts the request,
        as the sync client's does."""
        call = getattr(self, "_call", None)
        if call is not None:
            try:
                call.cancel()  # a no-op once the call has ended
            except Exception:   # its loop already closed
                pass


class AsyncInferenceClient:
    """An asyncio client of one Inference server; the arguments are InferenceClient's."""

    def __init__(self, address: str, timeout: float | None = None,
                 options: Sequence[tuple[str, Any]] = (), *, tls: ClientTLS | bool | None = None,
                 api_key: str | None = None) -> None:
        check_target(address, timeout)
        self.address = address
        self.timeout = timeout
        self.tls = client_tls(tls)
        self._metadata = auth_metadata(api_key)
        self._channel = aio_channel(address, self.tls, channel_options(options))
        self._stub = pb_grpc.InferenceStub(self._channel)
        self._closed = False

    async def close(self) -> None:
        self._closed = True
        await self._channel.close()

    def _check_open(self) -> None:
        if self._closed:   # grpc says so with its own exception types, which callers need not know
            raise KVServeError("CANCELLED", "the client is closed")

    async def __aenter__(self) -> AsyncInferenceClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def generate(self, prompt: str | None = None, token_ids: Sequence[int] | None = None,
                 messages: Sequence[Message] | None = None, **sampling: Any) -> AsyncGenerateStream:
        """Start a generation (not a coroutine: the call starts with the first read); the
        keywords are InferenceClient.generate's."""
        request = convert.generate_request(prompt, token_ids, messages, **sampling)
        self._check_open()
        call = self._stub.Generate(request, timeout=self.timeout, metadata=self._metadata)
        return AsyncGenerateStream(call, sampling.get("request_id", ""))

    async def complete(self, prompt: str | None = None, token_ids: Sequence[int] | None = None,
                       messages: Sequence[Message] | None = None, **sampling: Any) -> Completion:
        """generate(...) collected: the whole text and token ids, with the final usage."""
        collected = convert.Collector()
        async with self.generate(prompt, token_ids, messages, **sampling) as stream:
            async for event in stream:
                collected.add(event)
        return collected.completion()

    async def cancel(self, request_id: str) -> None:
        """Abort a request in flight by id (its stream ends with reason "abort");
        KVServeError NOT_FOUND when no such request is in flight."""
        await self._unary("Cancel", pb.CancelRequest(request_id=request_id))

    async def tokenize(self, prompt: str | None = None, messages: Sequence[Message] | None = None, *,
                       add_special_tokens: bool | None = None, **chat: Any) -> Tokenized:
        """The keywords are InferenceClient.tokenize's."""
        request = convert.tokenize_request(prompt, messages, add_special_tokens, **chat)
        return convert.tokenized(await self._unary("Tokenize", request))

    async def detokenize(self, token_ids: Sequence[int], *, skip_special_tokens: bool = False) -> str:
        """As InferenceClient.detokenize."""
        return (await self._unary("Detokenize", convert.detokenize_request(token_ids, skip_special_tokens))).text

    async def model_info(self) -> ModelInfo:
        return convert.model_info(await self._unary("GetModelInfo", pb.GetModelInfoRequest()))

    async def server_stats(self) -> ServerStats:
        return convert.server_stats(await self._unary("GetServerStats", pb.GetServerStatsRequest()))

    async def _unary(self, method: str, request: Any) -> Any:
        self._check_open()
        try:
            return await getattr(self._stub, method)(request, timeout=self.timeout, metadata=self._metadata)
        except grpc.RpcError as exc:
            raise KVServeError.from_rpc_error(exc) from exc
        except asyncio.CancelledError:   # as a stream's: the client closed under the call, not the task
            if not _task_cancelled():
                raise KVServeError("CANCELLED", "the call was cancelled (its client was closed)") from None
            raise
