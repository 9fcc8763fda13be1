"""Helpers for the model service's gRPC tests: build requests, drain streams, wait for pages."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc
import pytest

from kvserve.inference.v1 import inference_pb2 as pb

RPC_TIMEOUT_S = 60.0
VOCAB = 1024


def request(*, prompt: str | None = None, token_ids=None, messages=None, request_id: str = "",
            **sampling) -> pb.GenerateRequest:
    """A GenerateRequest; sampling fields go to SamplingParams (messages: [(role, content), ...])."""
    msg = pb.GenerateRequest(request_id=request_id, sampling=pb.SamplingParams(**sampling))
    if prompt is not None:
        msg.prompt = prompt
    if token_ids is not None:
        msg.token_ids.ids.extend(token_ids)
    if messages is not None:
        msg.messages.messages.extend(pb.ChatMessage(role=r, content=c) for r, c in messages)
    return msg


def greedy(max_tokens: int, **extra) -> dict:
    """Sampling fields of a greedy run of exactly max_tokens tokens (EOS ignored)."""
    return dict(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **extra)


@dataclass
class Stream:
    """Everything one Generate stream said, in order."""

    events: list[pb.GenerateResponse] = field(default_factory=list)

    @property
    def kinds(self) -> list[str]:
        return [e.WhichOneof("event") for e in self.events]

    @property
    def chunks(self) -> list[pb.TokenChunk]:
        return [e.chunk for e in self.events if e.HasField("chunk")]

    @property
    def tokens(self) -> list[int]:
        return [t for c in self.chunks for t in c.token_ids]

    @property
    def text(self) -> str:
        return "".join(c.text for c in self.chunks)

    @property
    def logprobs(self) -> list[pb.TokenLogprob]:
        return [lp for c in self.chunks for lp in c.logprobs]

    @property
    def prefill(self) -> pb.PrefillDone | None:
        return next((e.prefill_done for e in self.events if e.HasField("prefill_done")), None)

    @property
    def finished(self) -> pb.Finished | None:
        return next((e.finished for e in self.events if e.HasField("finished")), None)


def generate(stub, msg: pb.GenerateRequest, timeout: float = RPC_TIMEOUT_S) -> Stream:
    """Drains one Generate stream."""
    out = Stream()
    for event in stub.Generate(msg, timeout=timeout):
        out.events.append(event)
    return out


def rpc_error(fn: Callable[[], object]) -> grpc.RpcError:
    """The RpcError that fn() raises (a stream is drained); fails the test if none."""
    with pytest.raises(grpc.RpcError) as info:
        result = fn()
        if hasattr(result, "__iter__") and not isinstance(result, (str, bytes)):
            for _ in result:
                pass
    return info.value


def wait_until(predicate: Callable[[], bool], timeout: float = 10.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.01)


def idle_kv_stats(servicer, timeout: float = 10.0):
    """The in-process manager's Stats once the engine has nothing left to do."""
    assert servicer.engine.wait_idle(timeout), "the engine did not go idle"
    return servicer.stack.kv.stats()


def assert_pages_free(servicer) -> None:
    stats = idle_kv_stats(servicer)
    assert stats.used_pages == 0 and stats.num_sequences == 0, stats
