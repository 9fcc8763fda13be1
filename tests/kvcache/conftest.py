"""Fixtures for the KV-cache manager's gRPC tests.

The aio server runs on its own event loop in a background thread; tests talk to
it with ordinary synchronous channels, over TCP and over a Unix socket. Every
test gets a fresh manager, so page ids and seq ids start at 0 (FIFO).
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest

from kvserve.kvcache_service.core import KVCacheManager, ManagerConfig
from kvserve.kvcache_service.server import create_server
from tests.server_thread import LoopThread
from kvserve.kvcache.v1 import kvcache_pb2 as pb
from kvserve.kvcache.v1 import kvcache_pb2_grpc as pb_grpc
from kvserve.services.plumbing.grpc_server import RunningServer

# Small pools so that running out of pages takes a handful of calls.
GRPC_CONFIG = ManagerConfig(num_pages=16, page_size=4, max_seqs=8, cpu_pages=8)
RPC_TIMEOUT_S = 5.0


class ServerThread(LoopThread):
    """The manager's create_server(...) on a private event loop in a daemon thread."""

    def __init__(self, address: str, config: ManagerConfig, server=None) -> None:
        """`server`: a KVCacheServerConfig (TLS, the admin token); its listen is ignored."""
        super().__init__("kvcache-grpc-server")
        try:
            running, manager = self.call(create_server(address, config, server), timeout=10)
        except BaseException:
            self.close()
            raise
        self.running: RunningServer = running
        self.manager: KVCacheManager = manager
        self.address: str = running.address

    def stop(self) -> None:
        try:
            self.call(self.running.server.stop(None), timeout=10)
        finally:
            self.close()


class KV:
    """A synchronous client of one test server, plus the in-process manager.

    Only look at `manager` while no RPC is in flight: it lives on the server's loop.
    """

    def __init__(self, server: ServerThread) -> None:
        self.server = server
        self.address = server.address
        self.manager = server.manager
        self.channel = grpc.insecure_channel(server.address)
        self.stub = pb_grpc.KVCacheManagerStub(self.channel)
        # (No channel_ready_future: its connectivity watcher makes close() take 0.2 s.)

    def close(self) -> None:
        self.channel.close()

    # -- thin wrappers, each with a timeout so a hung server fails the test fast

    def call(self, method: str, request):
        return getattr(self.stub, method)(request, timeout=RPC_TIMEOUT_S)

    def stats(self) -> pb.Stats:
        return self.call("GetStats", pb.GetStatsRequest())

    def step(self, *, needs=(), commits=(), releases=(), truncations=(), epoch=0,
             mode=pb.PREEMPTION_MODE_UNSPECIFIED) -> pb.StepResponse:
        return self.call("Step", pb.StepRequest(epoch=epoch, releases=releases, truncations=truncations,
                                                commits=commits, needs=needs, preemption_mode=mode))

    def allocate(self, need: pb.Need) -> pb.AllocateResponse:
        return self.call("Allocate", pb.AllocateRequest(need=need))

    def can_allocate(self, need: pb.Need) -> pb.CanAllocateResponse:
        return self.call("CanAllocate", pb.CanAllocateRequest(need=need))

    def admit(self, request_id: str, tokens, **kw) -> pb.NeedResult:
        """Allocate one admission; returns its NeedResult."""
        return self.allocate(admit(request_id, tokens, **kw)).result

    def commit(self, seq_id: int, num_computed: int, token_ids=()) -> int:
        c = pb.Commit(seq_id=seq_id, num_computed=num_computed, token_ids=token_ids)
        return self.call("Commit", pb.CommitRequest(commit=c)).pages_stored

    def release(self, **ref) -> pb.ReleaseResponse:
        return self.call("Release", pb.ReleaseRequest(seq=pb.SequenceRef(**ref)))

    def seq(self, **ref) -> pb.SequenceInfo:
        return self.call("GetSequence", pb.GetSequenceRequest(seq=pb.SequenceRef(**ref)))


# -- message builders -------------------------------------------------------------

def admit(request_id: str, tokens, extra_key: str = "", max_tokens: int | None = None) -> pb.Need:
    a = pb.Admit(request_id=request_id, token_ids=tokens, extra_key=extra_key)
    if max_tokens is not None:
        a.max_tokens = max_tokens
    return pb.Need(admit=a)


def grow(seq_id: int, num_tokens: int) -> pb.Need:
    return pb.Need(grow=pb.Grow(seq_id=seq_id, num_tokens=num_tokens))


def resume(seq_id: int, num_tokens: int = 0) -> pb.Need:
    return pb.Need(resume=pb.Resume(seq_id=seq_id, num_tokens=num_tokens))


def fork(parent_seq_id: int, request_id: str) -> pb.Need:
    return pb.Need(fork=pb.Fork(parent_seq_id=parent_seq_id, request_id=request_id))


def commit(seq_id: int, num_computed: int, token_ids=()) -> pb.Commit:
    return pb.Commit(seq_id=seq_id, num_computed=num_computed, token_ids=token_ids)


def copies(msgs) -> list[tuple[int, int]]:
    return [(c.src, c.dst) for c in msgs]


def rpc_error(fn: Callable[[], object]) -> grpc.RpcError:
    """The RpcError fn() raises; fails the test if it returns normally."""
    with pytest.raises(grpc.RpcError) as info:
        fn()
    return info.value


# -- shared expectations for GRPC_CONFIG servers -----------------------------------

RECOMPUTE = pb.PREEMPTION_MODE_RECOMPUTE
SWAP = pb.PREEMPTION_MODE_SWAP
RUNNING = pb.SEQUENCE_STATE_RUNNING
SWAPPED = pb.SEQUENCE_STATE_SWAPPED

T10 = list(range(100, 110))  # 10 tokens: two full pages and a partial one
T16 = list(range(200, 216))  # 16 tokens: four full pages


def fresh_stats(**changes) -> pb.Stats:
    """GetStats of an untouched GRPC_CONFIG server, with `changes` applied."""
    fields = dict(total_pages=16, free_pages=16, cached_pages=0, used_pages=0, num_sequences=0,
                  free_seq_ids=8, cpu_total_pages=8, cpu_free_pages=8, prefix_query_tokens=0,
                  prefix_hit_tokens=0, evictions=0, preemptions_recompute=0, preemptions_swap=0,
                  page_size=4, max_seqs=8, num_swapped=0, epoch=0, tree_pages=0, last_event=0)
    fields.update(changes)
    return pb.Stats(**fields)


def prompt(i: int) -> list[int]:
    """16 tokens, different for every i."""
    return list(range(1000 * i, 1000 * i + 16))


def fill_four(kv: KV, epoch: int = 0) -> None:
    """Seqs 0..3 ('r0'..'r3'), 16 uncommitted tokens each: pages 0-3, 4-7, 8-11, 12-15."""
    step = kv.step(epoch=epoch, needs=[admit(f"r{i}", prompt(i)) for i in range(4)])
    assert [list(r.page_ids) for r in step.results] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11],
                                                        [12, 13, 14, 15]]
    assert step.available_pages == 0


def pools(s: pb.Stats) -> dict[str, int]:
    """The Stats fields that describe state (not the cumulative counters)."""
    counters = {"prefix_query_tokens", "prefix_hit_tokens", "evictions", "preemptions_recompute",
                "preemptions_swap"}
    return {f.name: getattr(s, f.name) for f in s.DESCRIPTOR.fields if f.name not in counters}


# -- fixtures ---------------------------------------------------------------------

def _unix_address(tmp_path: Path) -> str:
    path = tmp_path / "kv.sock"
    if len(os.fsencode(str(path))) > 100:  # sun_path limit; pytest's tmp dirs are usually far shorter
        path = Path(tempfile.mkdtemp(prefix="kv")) / "kv.sock"
    return f"unix://{path}"


@pytest.fixture(params=["tcp", "unix"])
def transport(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture
def kv_factory(transport: str, tmp_path: Path) -> Iterator[Callable[..., KV]]:
    """Starts servers (on the test's transport) with a given config; stops them after the test."""
    started: list[tuple[ServerThread, KV]] = []

    def start(config: ManagerConfig = GRPC_CONFIG) -> KV:
        if transport == "tcp":
            address = "127.0.0.1:0"
        else:
            sub = tmp_path / f"s{len(started)}"
            sub.mkdir()
            address = _unix_address(sub)
        server = ServerThread(address, config)
        client = KV(server)
        started.append((server, client))
        return client

    yield start
    for server, client in reversed(started):
        client.close()
        server.stop()


@pytest.fixture
def kv(kv_factory: Callable[..., KV]) -> KV:
    """A fresh server with GRPC_CONFIG and a client of it."""
    return kv_factory()
