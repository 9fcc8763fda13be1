"""The engine's link to the KV-cache manager: in-process, or remote over gRPC.

Both speak the core's plain types (kvcache_service.core.types); the remote one
converts at its edge, so the engine never sees protobuf.
"""

from __future__ import annotations

import queue
from collections.abc import Callable
from typing import Protocol

from kvserve.kvcache_service.core import KVCacheManager
from kvserve.kvcache_service.core.types import (
    Admit,
    Fork,
    Grow,
    NeedResult,
    Preemption,
    PreemptionMode,
    Resume,
    Stats,
    StepPlan,
    StepRequest,
)


class KVClient(Protocol):
    def register(self, epoch: int, page_size: int, num_pages: int) -> None: ...
    def send_step(self, request: StepRequest) -> Callable[[], StepPlan]:
        """Sends a Step now; the callable waits for its answer. Steps are answered in order."""
        ...
    def stats(self) -> Stats: ...
    def close(self) -> None: ...


class InProcessKVClient:
    """The manager in the engine's own process (`--kvcache inprocess`)."""

    def __init__(self, manager: KVCacheManager) -> None:
        self.manager = manager

    def register(self, epoch: int, page_size: int, num_pages: int) -> None:
        self.manager.register(epoch, page_size, num_pages)

    def send_step(self, request: StepRequest) -> Callable[[], StepPlan]:
        try:
            plan = self.manager.step(request)
        except Exception as exc:  # raised where the answer is awaited, as the remote client does
            def fail() -> StepPlan:
                raise exc
            return fail
        return lambda: plan

    def stats(self) -> Stats:
        return self.manager.stats()

    def close(self) -> None:
        pass


class RemoteKVClient:
    """A KVCacheManager service at `address` (host:port or unix:///path)."""

    def __init__(self, address: str, timeout_s: float = 30.0) -> None:
        import grpc

        from kvserve.kvcache.v1 import kvcache_pb2 as pb
        from kvserve.kvcache.v1 import kvcache_pb2_grpc as pb_grpc

        self._pb = pb
        self._channel = grpc.insecure_channel(address, options=[
            ("grpc.max_send_message_length", 64 << 20), ("grpc.max_receive_message_length", 64 << 20),
            ("grpc.keepalive_time_ms", 10_000), ("grpc.keepalive_timeout_ms", 5_000),
            ("grpc.keepalive_permit_without_calls", 1)])
        self._stub = pb_grpc.KVCacheManagerStub(self._channel)
        self._timeout = timeout_s
        self._stream: _StepStream | None = None
        self.address = address

    def wait_ready(self, timeout_s: float) -> None:
        import grpc
        try:
            grpc.channel_ready_future(self._channel).result(timeout=timeout_s)
        except grpc.FutureTimeoutError:
            raise ConnectionError(f"the KV-cache manager at {self.address} did not answer "
                                  f"within {timeout_s:.0f} s") from None

    def register(self, epoch: int, page_size: int, num_pages: int) -> None:
        import grpc
        try:
            self._stub.Register(self._pb.RegisterRequest(epoch=epoch, page_size=page_size, num_pages=num_pages),
                                timeout=self._timeout)
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.INVALID_ARGUMENT:
                raise ValueError(f"the KV-cache manager at {self.address} refused to register this model service: "
                                 f"{exc.details().removeprefix('register: ')} (start both with the same "
                                 "--page-size and --num-pages, or use `kvserve up`)") from None
            raise ConnectionError(f"the KV-cache manager at {self.address}: {exc.code().name}: {exc.details()}") from None

    def send_step(self, request: StepRequest) -> Callable[[], StepPlan]:
        """One Step over the long-lived StepStream (opened on first use, reopened after an error)."""
        if self._stream is None:
            self._stream = _StepStream(self._stub)
        stream = self._stream
        stream.send(_step_to_pb(self._pb, request))

        def answer() -> StepPlan:
            try:
                return _plan_from_pb(stream.receive())
            except Exception:
                stream.close()
                if self._stream is stream:
                    self._stream = None
                raise
        return answer

    def stats(self) -> Stats:
        s = self._stub.GetStats(self._pb.GetStatsRequest(), timeout=self._timeout)
        return Stats(**{f: getattr(s, f) for f in Stats.__slots__})

    def close(self) -> None:
        if self._stream is not None:
            self._stream.close()
        self._channel.close()


class _StepStream:
    """Request in, response out, over one bidirectional stream: no per-call setup."""

    def __init__(self, stub) -> None:
        self._requests: queue.SimpleQueue = queue.SimpleQueue()
        self._responses = stub.StepStream(iter(self._requests.get, None))

    def send(self, request) -> None:
        self._requests.put(request)

    def call(self, request):
        self.send(request)
        return self.receive()

    def receive(self):
        # No per-message deadline on a stream: a dead manager is caught by the
        # channel's keepalive pings, which end the stream with UNAVAILABLE.
        return next(self._responses)

    def close(self) -> None:
        self._requests.put(None)
        self._responses.cancel()


def _add_need(needs, need) -> None:
    """Appends `need` to a repeated Need field, filled in place."""
    kind = type(need)
    if kind is Grow:
        g = needs.add().grow
        g.seq_id = need.seq_id
        g.num_tokens = need.num_tokens
    elif kind is Admit:
        a = needs.add().admit
        a.request_id = need.request_id
        a.token_ids.extend(need.token_ids)
        if need.extra_key:
            a.extra_key = need.extra_key
        if need.max_tokens is not None:
            a.max_tokens = need.max_tokens
    elif kind is Resume:
        r = needs.add().resume
        r.seq_id = need.seq_id
        r.num_tokens = need.num_tokens
    else:
        assert kind is Fork
        f = needs.add().fork
        f.parent_seq_id = need.parent_seq_id
        f.request_id = need.request_id


def _step_to_pb(pb, r: StepRequest):
    # Sub-messages are filled in place (repeated.add()): constructing each one and handing
    # a list of them to the constructor makes upb copy every one again (2x the time).
    msg = pb.StepRequest(epoch=r.epoch, releases=r.releases, preemption_mode=int(r.preemption_mode))
    if r.truncations:
        add = msg.truncations.add
        for t in r.truncations:
            add(seq_id=t.seq_id, num_tokens=t.num_tokens)
    add = msg.commits.add
    for c in r.commits:
        add(seq_id=c.seq_id, num_computed=c.num_computed, token_ids=c.token_ids)
    needs = msg.needs
    for n in r.needs:
        _add_need(needs, n)
    return msg


def _plan_from_pb(msg) -> StepPlan:
    return StepPlan(
        results=[NeedResult(r.granted, r.seq_id, r.page_ids[:], r.replaces_table, r.cached_tokens,
                            r.num_tokens, r.reason) for r in msg.results],
        preempted=[Preemption(p.seq_id, p.request_id, PreemptionMode(p.mode)) for p in msg.preempted],
        swap_out=[(c.src, c.dst) for c in msg.swap_out],
        copies=[(c.src, c.dst) for c in msg.copies],
        swap_in=[(c.src, c.dst) for c in msg.swap_in],
        available_pages=msg.available_pages,
    )
