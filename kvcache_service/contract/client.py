"""The link to a KV-cache manager: in-process, or remote over gRPC.

Both speak the contract's plain types (types.py) and raise its errors (errors.py): the remote
one converts at its edge (convert.py, status.py), so its user (the model service's engine, a
gateway) never sees protobuf or a grpc.RpcError. ManagerUnavailable means the manager did not
answer; the remote client's channel then reconnects by itself, quickly (a restarted manager on
the same address is found within about a second), and the next Step opens a new stream.
"""

from __future__ import annotations

import os
import queue
import socket
import threading
from collections.abc import Callable
from typing import Protocol

import grpc

from kvserve.kvcache.v1 import kvcache_pb2 as pb
from kvserve.kvcache.v1 import kvcache_pb2_grpc as pb_grpc
from kvserve.kvcache_service.contract import convert
from kvserve.kvcache_service.contract.errors import InvalidArgument, ManagerUnavailable
from kvserve.kvcache_service.contract.status import error_from_rpc
from kvserve.kvcache_service.contract.types import Stats, StepPlan, StepRequest
from kvserve.services.plumbing.tls import ClientTLS, channel as tls_channel

# gRPC's default reconnect backoff grows to two minutes; a restarted manager is found sooner.
# RegisterRequest.instance: which process holds the manager's pool, for its log
INSTANCE = f"{socket.gethostname()} pid {os.getpid()}"

_CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", 64 << 20), ("grpc.max_receive_message_length", 64 << 20),
    ("grpc.keepalive_time_ms", 10_000), ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.initial_reconnect_backoff_ms", 100), ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
]


class KVClient(Protocol):
    address: str

    def register(self, epoch: int, page_size: int, num_pages: int, timeout_s: float | None = None,
                 cpu_pages: int | None = None) -> None:
        """cpu_pages: the caller's swap pages, checked against the manager's. Raises KVCacheError: InvalidArgument for sizes the manager does not share,
        FailedPrecondition for an epoch older than its live one, ManagerUnavailable."""
        ...

    def send_step(self, request: StepRequest) -> Callable[[], StepPlan]:
        """Sends a Step now; the callable waits for its answer (raising the KVCacheError the
        Step met). Steps are answered in order."""
        ...

    def interrupt(self) -> None:
        """From another thread: a wait for an answer ends now, with ManagerUnavailable."""
        ...

    def reset(self) -> None:
        """Forgets the Steps sent and not awaited (the engine dropped them): the next Step's
        answer is its own, not one of theirs."""
        ...

    def stats(self, timeout_s: float | None = None) -> Stats: ...
    def close(self) -> None: ...


class InProcessKVClient:
    """A manager in the caller's own process (`--kvcache inprocess`): any object with the
    core's register / step / stats (kvcache_service.core.KVCacheManager)."""

    address = "inprocess"

    def __init__(self, manager) -> None:
        self.manager = manager

    def register(self, epoch: int, page_size: int, num_pages: int, timeout_s: float | None = None,
                 cpu_pages: int | None = None) -> None:
        self.manager.register(epoch, page_size, num_pages, cpu_pages)

    def send_step(self, request: StepRequest) -> Callable[[], StepPlan]:
        try:
            plan = self.manager.step(request)
        except Exception as exc:  # raised where the answer is awaited, as the remote client does
            error = exc   # `exc` itself is unbound when the except block ends

            def fail() -> StepPlan:
                raise error
            return fail
        return lambda: plan

    def interrupt(self) -> None:
        pass   # an in-process Step is answered before send_step returns

    def reset(self) -> None:
        pass   # nothing is left unanswered

    def stats(self, timeout_s: float | None = None) -> Stats:
        return self.manager.stats()

    def close(self) -> None:
        pass


class RemoteKVClient:
    """A KVCacheManager service at `address` (host:port or unix:///path)."""

    def __init__(self, address: str, timeout_s: float = 30.0, tls: ClientTLS | None = None, token: str = "") -> None:
        """`tls`: reach a TCP address over TLS; `token`: the manager's admin token, for one beyond
        this pod (its write RPCs refuse other callers: services/plumbing/auth.py)."""
        self._channel = tls_channel(address, tls, _CHANNEL_OPTIONS)
        self._stub = pb_grpc.KVCacheManagerStub(self._channel)
        self._metadata = (("authorization", f"Bearer {token}"),) if token else ()
        self._timeout = timeout_s
        self._stream: _StepStream | None = None
        self.address = address

    def wait_ready(self, timeout_s: float) -> None:
        try:
            grpc.channel_ready_future(self._channel).result(timeout=timeout_s)
        except grpc.FutureTimeoutError:
            raise ConnectionError(f"the KV-cache manager at {self.address} did not answer "
                                  f"within {timeout_s:.0f} s") from None

    def register(self, epoch: int, page_size: int, num_pages: int, timeout_s: float | None = None,
                 cpu_pages: int | None = None) -> None:
        """Waits for the channel up to `timeout_s` (default: the client's timeout)."""
        try:
            self._stub.Register(pb.RegisterRequest(epoch=epoch, page_size=page_size, num_pages=num_pages,
                                                   cpu_pages=cpu_pages, instance=INSTANCE),
                                timeout=self._timeout if timeout_s is None else timeout_s, wait_for_ready=True,
                                metadata=self._metadata)
        except grpc.RpcError as exc:
            error = error_from_rpc(exc, self.address)
            if isinstance(error, InvalidArgument):
                raise InvalidArgument(
                    f"the KV-cache manager at {self.address} refused to register this model service: "
                    f"{str(error).removeprefix('register: ')} (start both with the same --page-size and "
                    "--num-pages, the model service's --swap-pages at least the manager's --cpu-pages, or use "
                    "`kvserve up`)") from None
            raise error from None

    def send_step(self, request: StepRequest) -> Callable[[], StepPlan]:
        """One Step over the long-lived StepStream (opened on first use, reopened after an error)."""
        if self._stream is None:
            self._stream = _StepStream(self._stub, self._metadata)
        stream = self._stream
        stream.send(convert.step_request_to_pb(request))

        def answer() -> StepPlan:
            try:
                return convert.step_plan_from_pb(stream.receive())
            except grpc.RpcError as exc:
                self._drop(stream)
                raise error_from_rpc(exc, self.address) from None
            except BaseException:
                self._drop(stream)
                raise
        return answer

    def interrupt(self) -> None:
        self.reset()   # a receive() waiting on the stream raises CANCELLED: ManagerUnavailable

    def reset(self) -> None:
        stream = self._stream
        if stream is not None:   # answers to the dropped Steps would come first on it;
            self._drop(stream)   # the next Step opens a new stream

    def _drop(self, stream: _StepStream) -> None:
        stream.close()
        if self._stream is stream:
            self._stream = None

    def stats(self, timeout_s: float | None = None) -> Stats:
        """`timeout_s`: the wait for an answer (default: the client's)."""
        try:
            return convert.stats_from_pb(self._stub.GetStats(pb.GetStatsRequest(), timeout=timeout_s or self._timeout))
        except grpc.RpcError as exc:
            raise error_from_rpc(exc, self.address) from None

    def close(self) -> None:
        if self._stream is not None:
            self._stream.close()
        self._channel.close()


class _StepStream:
    """Request in, response out, over one bidirectional stream: no per-call setup.

    A reader thread takes each answer off the stream as it arrives, so that when the engine asks
    for it, it is usually waiting in a queue. Read on demand (`next()` on the call), the read
    only starts when the engine asks, and the engine then waits for gRPC's threads to take the
    GIL in turn behind everything else the process runs: under 256 streams that was most of the
    engine's wait for a manager that answers in 1 ms (docs/benchmarks.md)."""

    def __init__(self, stub, metadata: tuple = ()) -> None:
        self._requests: queue.SimpleQueue = queue.SimpleQueue()
        self._responses = stub.StepStream(iter(self._requests.get, None), metadata=metadata)
        self._answers: queue.SimpleQueue = queue.SimpleQueue()   # responses, then how the stream ended
        threading.Thread(target=self._read, name="kvserve-step-reader", daemon=True).start()

    def _read(self) -> None:
        try:
            for response in self._responses:
                self._answers.put(response)
            self._answers.put(ManagerUnavailable("the KV-cache manager ended the Step stream"))
        except BaseException as exc:   # grpc.RpcError: cancelled (close), or the manager lost
            self._answers.put(exc)

    def send(self, request) -> None:
        self._requests.put(request)

    def receive(self):
        # No per-message deadline on a stream: a dead manager is caught by the channel's
        # keepalive pings, a stalled one by the engine, which interrupts the wait.
        answer = self._answers.get()
        if isinstance(answer, BaseException):
            self._answers.put(answer)   # every later receive ends the same way
            raise answer
        return answer

    def close(self) -> None:
        self._responses.cancel()   # first: ended requests alone would let the manager end it cleanly
        self._requests.put(None)
