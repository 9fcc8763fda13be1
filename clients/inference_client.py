"""A small, typed Python client for kvserve's Inference service.

    from kvserve.clients.inference_client import InferenceClient, Chunk

    with InferenceClient("127.0.0.1:50051") as client:
        for event in client.generate("Once upon a time", max_tokens=32, temperature=0):
            if isinstance(event, Chunk):
                print(event.text, end="", flush=True)
        print(client.complete(messages=[{"role": "user", "content": "hi"}]).text)

Everything returned is a plain frozen dataclass converted from protobuf here,
at the edge, so callers never touch generated messages. Every failed call
raises KVServeError(code, message), code being the gRPC status name
("INVALID_ARGUMENT", "NOT_FOUND", ...); the grpc.RpcError is its __cause__.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any, TypeVar

import grpc

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
    WorkerStats,
    Tokenized,
    TokenLogprob,
    TopLogprob,
)
from kvserve.inference.v1 import inference_pb2 as pb
from kvserve.kvcache_service.contract.convert import stats_from_pb
from kvserve.inference.v1 import inference_pb2_grpc as pb_grpc

__all__ = [
    "Chunk", "Completion", "Event", "Finished", "GenerateStream", "InferenceClient", "KVCacheStats",
    "KVServeError", "Message", "ModelInfo", "PrefillDone", "Queued", "ServerStats", "Tokenized", "WorkerStats",
    "TokenLogprob", "TopLogprob",
]


_T = TypeVar("_T")


# --------------------------------------------------------------------------- conversion (the edge)

def _scalars(cls: type[_T], msg: Any, **extra: Any) -> _T:
    """cls(**{field: msg.field}) for every dataclass field not given in extra."""
    values = {f.name: getattr(msg, f.name) for f in dataclasses.fields(cls) if f.name not in extra}
    return cls(**values, **extra)


def _token_logprobs(items: Iterable[Any]) -> tuple[TokenLogprob, ...]:
    return tuple(TokenLogprob(lp.token_id, lp.logprob, tuple(TopLogprob(t.token_id, t.logprob) for t in lp.top))
                 for lp in items)


def _finish_reason(value: int) -> str:
    return pb.FinishReason.Name(value).removeprefix("FINISH_REASON_").lower()


def _event(msg: pb.GenerateResponse) -> Event | None:
    kind = msg.WhichOneof("event")
    if kind == "chunk":
        c = msg.chunk
        return Chunk(tuple(c.token_ids), c.text, _token_logprobs(c.logprobs))
    if kind == "prefill_done":
        p = msg.prefill_done
        return PrefillDone(p.request_id, p.prompt_tokens, p.cached_tokens)
    if kind == "finished":
        f = msg.finished
        return Finished(_finish_reason(f.finish_reason), f.usage.prompt_tokens, f.usage.completion_tokens,
                        f.usage.cached_tokens, f.ttft_ms, f.total_ms, f.stop,
                        f.stop_token_id if f.HasField("stop_token_id") else None)
    if kind == "queued":
        return Queued(msg.queued.position, msg.queued.eta_ms)
    return None  # an event this client does not know (a newer server): skipped


def _chat(messages: Sequence[Message]) -> pb.ChatMessages:
    out = pb.ChatMessages()
    for m in messages:
        if isinstance(m, Mapping):
            role, content = m["role"], m["content"]
        elif isinstance(m, tuple):
            role, content = m
        else:
            role, content = m.role, m.content
        out.messages.append(pb.ChatMessage(role=role, content=content))
    return out


def _one_input(**inputs: Any) -> dict[str, Any]:
    given = {k: v for k, v in inputs.items() if v is not None}
    if len(given) > 1:
        raise ValueError(f"give one input, not {' and '.join(given)}")
    return given  # none given: the server answers INVALID_ARGUMENT


# --------------------------------------------------------------------------- the stream

class GenerateStream(Iterator[Event]):
    """The events of one Generate call; iterate it. cancel() (or close(), or
    leaving a `with` block, or dropping it unfinished) aborts the request on the
    server, which frees its KV pages within one engine step."""

    def __init__(self, call: Any, request_id: str = "") -> None:
        self._call = call
        self.request_id = request_id  # filled in from prefill_done when the server assigns it
        self.finished: Finished | None = None

    def __iter__(self) -> GenerateStream:
        return self

    def __next__(self) -> Event:
        while True:
            try:
                msg = next(self._call)
            except grpc.RpcError as exc:
                raise KVServeError.from_rpc_error(exc) from exc
            event = _event(msg)
            if isinstance(event, PrefillDone):
                self.request_id = event.request_id or self.request_id
            elif isinstance(event, Finished):
                self.finished = event
            if event is not None:
                return event

    def cancel(self) -> None:
        """Abort the call; further iteration raises KVServeError("CANCELLED", ...)."""
        self._call.cancel()

    close = cancel

    def __enter__(self) -> GenerateStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.cancel()

    def __del__(self) -> None:
        call = getattr(self, "_call", None)
        if call is not None:
            try:
                call.cancel()  # a no-op once the call has ended
            except Exception:
                pass


# --------------------------------------------------------------------------- the client

class InferenceClient:
    """A synchronous client of one Inference server.

    address: host:port or unix:///path. timeout: the deadline in seconds of
    every call (for generate, of the whole stream); None: no deadline.
    """

    def __init__(self, address: str, timeout: float | None = None,
                 options: Sequence[tuple[str, Any]] = ()) -> None:
        self.address = address
        self.timeout = timeout
        self._channel = grpc.insecure_channel(address, options=list(options))
        self._stub = pb_grpc.InferenceStub(self._channel)

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> InferenceClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---------------------------------------------------------------- Generate

    def generate(
        self,
        prompt: str | None = None,
        token_ids: Sequence[int] | None = None,
        messages: Sequence[Message] | None = None,
        *,
        max_tokens: int | None = None,
        temperature: float | None = None,
        top_p: float | None = None,
        top_k: int = 0,
        min_p: float = 0.0,
        seed: int | None = None,
        stop: Sequence[str] = (),
        stop_token_ids: Sequence[int] = (),
        ignore_eos: bool = False,
        logprobs: int | None = None,
        repetition_penalty: float | None = None,
        presence_penalty: float = 0.0,
        frequency_penalty: float = 0.0,
        skip_special_tokens: bool | None = None,
        request_id: str = "",
        session_id: str = "",
    ) -> GenerateStream:
        """Start a generation; iterate the result for PrefillDone, Chunk..., Finished
        (a gateway may send Queued first). Give exactly one of prompt, token_ids, messages.
        Unset (None) parameters take the server's defaults."""
        if isinstance(stop, str):
            stop = (stop,)
        sampling = pb.SamplingParams(top_k=top_k, min_p=min_p, presence_penalty=presence_penalty,
                                     frequency_penalty=frequency_penalty, stop=list(stop),
                                     stop_token_ids=list(stop_token_ids), ignore_eos=ignore_eos)
        optional = dict(temperature=temperature, top_p=top_p, seed=seed, max_tokens=max_tokens,
                        logprobs=logprobs, repetition_penalty=repetition_penalty,
                        skip_special_tokens=skip_special_tokens)
        for name, value in optional.items():
            if value is not None:
                setattr(sampling, name, value)
        request = pb.GenerateRequest(request_id=request_id, session_id=session_id, sampling=sampling)
        inputs = _one_input(prompt=prompt, token_ids=token_ids, messages=messages)
        if "prompt" in inputs:
            request.prompt = prompt
        elif "token_ids" in inputs:
            request.token_ids.SetInParent()  # set even when empty, so the server says what is wrong
            request.token_ids.ids.extend(token_ids)
        elif "messages" in inputs:
            request.messages.SetInParent()
            request.messages.MergeFrom(_chat(messages))
        try:
            call = self._stub.Generate(request, timeout=self.timeout)
        except grpc.RpcError as exc:  # raised here only by a broken channel; statuses come while iterating
            raise KVServeError.from_rpc_error(exc) from exc
        return GenerateStream(call, request_id)

    def complete(self, prompt: str | None = None, token_ids: Sequence[int] | None = None,
                 messages: Sequence[Message] | None = None, **kwargs: Any) -> Completion:
        """generate(...) collected: the whole text and token ids, with the final usage."""
        text: list[str] = []
        ids: list[int] = []
        logprobs: list[TokenLogprob] = []
        prefill: PrefillDone | None = None
        finished: Finished | None = None
        with self.generate(prompt, token_ids, messages, **kwargs) as stream:
            for event in stream:
                if isinstance(event, Chunk):
                    text.append(event.text)
                    ids.extend(event.token_ids)
                    logprobs.extend(event.logprobs)
                elif isinstance(event, PrefillDone):
                    prefill = event
                elif isinstance(event, Finished):
                    finished = event
        if finished is None:
            raise KVServeError("INTERNAL", "the stream ended without a finished event")
        return Completion("".join(text), tuple(ids), finished, prefill, tuple(logprobs))

    # ---------------------------------------------------------------- unary calls

    def cancel(self, request_id: str) -> None:
        """Abort a request in flight by id (its stream ends with reason "abort");
        KVServeError NOT_FOUND when no such request is in flight."""
        self._unary("Cancel", pb.CancelRequest(request_id=request_id))

    def tokenize(self, prompt: str | None = None, messages: Sequence[Message] | None = None, *,
                 add_special_tokens: bool | None = None) -> Tokenized:
        """The token ids the server would feed the model for this prompt, or for these
        messages rendered with the chat template (with the generation prompt)."""
        request = pb.TokenizeRequest()
        inputs = _one_input(prompt=prompt, messages=messages)
        if "prompt" in inputs:
            request.prompt = prompt
        elif "messages" in inputs:
            request.messages.SetInParent()
            request.messages.MergeFrom(_chat(messages))
        if add_special_tokens is not None:
            request.add_special_tokens = add_special_tokens
        r = self._unary("Tokenize", request)
        return Tokenized(tuple(r.token_ids), tuple(r.tokens))

    def model_info(self) -> ModelInfo:
        r = self._unary("GetModelInfo", pb.GetModelInfoRequest())
        return _scalars(ModelInfo, r, eos_token_ids=tuple(r.eos_token_ids))

    def server_stats(self) -> ServerStats:
        r = self._unary("GetServerStats", pb.GetServerStatsRequest())
        kv = stats_from_pb(r.kvcache) if r.HasField("kvcache") else None
        return _scalars(ServerStats, r, kvcache=kv, workers=tuple(_scalars(WorkerStats, w) for w in r.workers))

    def _unary(self, method: str, request: Any) -> Any:
        try:
            return getattr(self._stub, method)(request, timeout=self.timeout)
        except grpc.RpcError as exc:
            raise KVServeError.from_rpc_error(exc) from exc
