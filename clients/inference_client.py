"""A small, typed Python client for kvserve's Inference service.

    from kvserve.clients.inference_client import InferenceClient, Chunk

    with InferenceClient("127.0.0.1:50051") as client:
        for event in client.generate("Once upon a time", max_tokens=32, temperature=0):
            if isinstance(event, Chunk):
                print(event.text, end="", flush=True)
        print(client.complete(messages=[{"role": "user", "content": "hi"}]).text)

    # over TLS (mutual TLS with cert= and key=) to a server that wants an API key
    InferenceClient("kvserve.example:443", tls=ClientTLS(ca="ca.pem"), api_key="KEY")

Everything returned is a plain frozen dataclass converted from protobuf at the
edge (convert.py), so callers never touch generated messages. Every failed call
raises KVServeError(code, message), code being the gRPC status name
("INVALID_ARGUMENT", "NOT_FOUND", ...); the grpc.RpcError is its __cause__.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
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
    WorkerStats,
    Tokenized,
    TokenLogprob,
    TopLogprob,
)
from kvserve.inference.v1 import inference_pb2 as pb
from kvserve.inference.v1 import inference_pb2_grpc as pb_grpc
from kvserve.services.plumbing.tls import ClientTLS, channel

__all__ = [
    "Chunk", "ClientTLS", "Completion", "Event", "Finished", "GenerateStream", "InferenceClient", "KVCacheStats",
    "KVServeError", "Message", "ModelInfo", "PrefillDone", "Queued", "ServerStats", "Tokenized", "WorkerStats",
    "TokenLogprob", "TopLogprob",
]


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
            event = convert.stream_event(self, msg)
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
    tls: None (plaintext), True (TLS trusting the system's roots) or
    ClientTLS(ca=, cert=, key=, server_name=): the CA that signed the server's
    certificate, this client's certificate and key for mutual TLS, and the name
    to check the server's certificate against when it is not the address's host.
    Unix sockets stay plaintext. api_key: sent as `authorization: Bearer KEY`
    with every call.
    """

    def __init__(self, address: str, timeout: float | None = None,
                 options: Sequence[tuple[str, Any]] = (), *, tls: ClientTLS | bool | None = None,
                 api_key: str | None = None) -> None:
        check_target(address, timeout)
        self.address = address
        self.timeout = timeout
        self.tls = client_tls(tls)
        self._metadata = auth_metadata(api_key)
        self._channel = channel(address, self.tls, channel_options(options))
        self._stub = pb_grpc.InferenceStub(self._channel)
        self._closed = False

    def close(self) -> None:
        self._closed = True
        self._channel.close()

    def _check_open(self) -> None:
        if self._closed:   # grpc says so with its own exception types, which callers need not know
            raise KVServeError("CANCELLED", "the client is closed")

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
        top_k: int | None = None,
        min_p: float | None = None,
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
        cache_salt: str = "",
        n: int | None = None,
        prompt_logprobs: int | None = None,
        logit_bias: Mapping[int, float] | None = None,
        min_tokens: int = 0,
        structured: Mapping[str, Any] | None = None,
        add_generation_prompt: bool | None = None,
        continue_final_message: bool = False,
        chat_template_kwargs: Mapping[str, Any] | None = None,
    ) -> GenerateStream:
        """Start a generation; iterate the result for PrefillDone, Chunk..., Finished
        (Queued first while it waits in a queue). Give exactly one of prompt, token_ids, messages.
        Unset (None) parameters take the server's defaults. With n > 1 the server samples n
        sequences from the prompt: each Chunk and Finished says which (`index`). prompt_logprobs
        asks for the prompt's own logprobs, in PrefillDone: the top-n of each token besides its
        own (0: its own only; None: none). Asked, the prompt is computed whole, past any cache hit. logit_bias
        adds to tokens' logits (token id -> [-100, 100]); min_tokens holds EOS and stop_token_ids
        back until that many tokens. structured holds the output to a format: {"json_schema": a
        schema}, {"json_object": True}, {"regex": ...}, {"choice": [...]} or {"lark_grammar": ...}.
        With messages, the chat template's options as vLLM takes them: add_generation_prompt
        (default true), continue_final_message (the last message continued, not closed) and
        chat_template_kwargs (the template's own variables, e.g. {"enable_thinking": False}).
        cache_salt keeps the request's prefix cache apart: its pages are shared only with
        requests of the same salt."""
        request = convert.generate_request(
            prompt, token_ids, messages, max_tokens=max_tokens, temperature=temperature, top_p=top_p,
            top_k=top_k, min_p=min_p, seed=seed, stop=stop, stop_token_ids=stop_token_ids, ignore_eos=ignore_eos,
            logprobs=logprobs, repetition_penalty=repetition_penalty, presence_penalty=presence_penalty,
            frequency_penalty=frequency_penalty, skip_special_tokens=skip_special_tokens,
            request_id=request_id, session_id=session_id, cache_salt=cache_salt, n=n,
            prompt_logprobs=prompt_logprobs,
            logit_bias=logit_bias, min_tokens=min_tokens, structured=structured,
            add_generation_prompt=add_generation_prompt, continue_final_message=continue_final_message,
            chat_template_kwargs=chat_template_kwargs)
        self._check_open()
        try:
            call = self._stub.Generate(request, timeout=self.timeout, metadata=self._metadata)
        except grpc.RpcError as exc:  # raised here only by a broken channel; statuses come while iterating
            raise KVServeError.from_rpc_error(exc) from exc
        return GenerateStream(call, request_id)

    def complete(self, prompt: str | None = None, token_ids: Sequence[int] | None = None,
                 messages: Sequence[Message] | None = None, **kwargs: Any) -> Completion:
        """generate(...) collected: the whole text and token ids, with the final usage."""
        collected = convert.Collector()
        with self.generate(prompt, token_ids, messages, **kwargs) as stream:
            for event in stream:
                collected.add(event)
        return collected.completion()

    # ---------------------------------------------------------------- unary calls

    def cancel(self, request_id: str) -> None:
        """Abort a request in flight by id (its stream ends with reason "abort");
        KVServeError NOT_FOUND when no such request is in flight."""
        self._unary("Cancel", pb.CancelRequest(request_id=request_id))

    def tokenize(self, prompt: str | None = None, messages: Sequence[Message] | None = None, *,
                 add_special_tokens: bool | None = None, add_generation_prompt: bool | None = None,
                 continue_final_message: bool = False,
                 chat_template_kwargs: Mapping[str, Any] | None = None) -> Tokenized:
        """The token ids the server would feed the model for this prompt, or for these
        messages rendered with the chat template (with the generation prompt unless the
        template's options, as generate() takes them, say otherwise)."""
        request = convert.tokenize_request(prompt, messages, add_special_tokens, add_generation_prompt,
                                           continue_final_message, chat_template_kwargs)
        return convert.tokenized(self._unary("Tokenize", request))

    def detokenize(self, token_ids: Sequence[int], *, skip_special_tokens: bool = False) -> str:
        """The text of these token ids as the server's tokenizer writes it (special tokens kept
        unless skip_special_tokens)."""
        return self._unary("Detokenize", convert.detokenize_request(token_ids, skip_special_tokens)).text

    def model_info(self) -> ModelInfo:
        return convert.model_info(self._unary("GetModelInfo", pb.GetModelInfoRequest()))

    def server_stats(self) -> ServerStats:
        return convert.server_stats(self._unary("GetServerStats", pb.GetServerStatsRequest()))

    def _unary(self, method: str, request: Any) -> Any:
        self._check_open()
        try:
            return getattr(self._stub, method)(request, timeout=self.timeout, metadata=self._metadata)
        except grpc.RpcError as exc:
            raise KVServeError.from_rpc_error(exc) from exc
