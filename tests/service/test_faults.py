"""Faults in the real processes: the manager killed (-9), stopped (SIGSTOP) or gone for good,
the model service killed under `kvserve up`, a stale Register. Streams that outlive a fault give
exactly the tokens of an undisturbed run; those that cannot end UNAVAILABLE; none hangs; no page
is left behind. Every wait is for a condition, with a deadline; nothing sleeps to assert.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import subprocess
import threading
import time
from dataclasses import dataclass, field

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvserve.inference.v1 import inference_pb2 as pb
from kvserve.inference.v1 import inference_pb2_grpc as pb_grpc
from kvserve.kvcache.v1 import kvcache_pb2 as kv_pb
from kvserve.kvcache.v1 import kvcache_pb2_grpc as kv_pb_grpc
from tests.service.processes import (alive, children, free_port, kv_stats, kvserve, stop_pids, terminate,
                                     wait_serving)
from tests.service.util import generate, greedy, request, rpc_error, wait_until

pytestmark = pytest.mark.slow

_rng = random.Random(99)
PROMPTS = [[_rng.randrange(3, 1024) for _ in range(n)] for n in (5, 12, 20, 33, 40, 51, 60, 70)]
NEW_TOKENS = 800   # long enough that every stream is still running at the third kill
MODEL_FLAGS = ("--device", "cpu", "--dtype", "float32", "--page-size", "4", "--num-pages", "2048")


@dataclass
class Recorded:
    """One Generate stream run on a thread: its tokens as they came, and how it ended."""
    tokens: list[int] = field(default_factory=list)
    code: grpc.StatusCode | None = None
    details: str = ""
    done: threading.Event = field(default_factory=threading.Event)


def stream(address: str, msg: pb.GenerateRequest, timeout: float = 60) -> Recorded:
    out = Recorded()

    def run() -> None:
        with grpc.insecure_channel(address) as ch:
            try:
                for event in pb_grpc.InferenceStub(ch).Generate(msg, timeout=timeout):
                    out.tokens += event.chunk.token_ids
                out.code = grpc.StatusCode.OK
            except grpc.RpcError as exc:
                out.code, out.details = exc.code(), exc.details()
        out.done.set()

    threading.Thread(target=run, daemon=True).start()
    return out


def streams(address: str, max_tokens: int = NEW_TOKENS) -> list[Recorded]:
    return [stream(address, request(token_ids=p, **greedy(max_tokens))) for p in PROMPTS]


def finish(recorded: list[Recorded], timeout: float = 60) -> None:
    for r in recorded:
        assert r.done.wait(timeout), "a stream hung"


def all_advanced(recorded: list[Recorded], since: list[int], by: int) -> bool:
    return all(len(r.tokens) >= min(n + by, NEW_TOKENS) for r, n in zip(recorded, since))


def running(up_pid: int, command: str) -> list[int]:
    """The live children of `kvserve up` running `kvserve <command>`."""
    out = []
    for pid in children(up_pid):
        try:
            argv = open(f"/proc/{pid}/cmdline", "rb").read().split(b"\0")
        except OSError:
            continue
        if command.encode() in argv and alive(pid):
            out.append(pid)
    return out


def pid_of(up_pid: int, command: str, other_than: int | None = None, timeout: float = 60) -> int:
    """The child of `kvserve up` running `kvserve <command>`, waiting for the supervisor to have
    started one (a new one, when `other_than` names the one just killed)."""
    found: list[int] = []

    def started() -> bool:
        found[:] = [p for p in running(up_pid, command) if p != other_than]
        return bool(found)

    wait_until(started, timeout=timeout, what=f"`kvserve {command}` under pid {up_pid}")
    return found[0]


def health_of(address: str, service: str = "") -> int:
    with grpc.insecure_channel(address) as ch:
        return health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=service), timeout=5).status


class HealthLog:
    """grpc.health.v1 Watch on a thread: every status the server reported, in order."""

    def __init__(self, address: str) -> None:
        self.statuses: list[int] = []
        self._channel = grpc.insecure_channel(address)
        self._call = health_pb2_grpc.HealthStub(self._channel).Watch(health_pb2.HealthCheckRequest())
        threading.Thread(target=self._run, daemon=True).start()
        wait_until(lambda: self.statuses, what="the first health status")

    def _run(self) -> None:
        try:
            for response in self._call:
                self.statuses.append(response.status)
        except grpc.RpcError:
            pass

    def close(self) -> None:
        self._call.cancel()
        self._channel.close()


# ------------------------------------------------------------------- under `kvserve up`


@pytest.fixture(scope="module")
def up(tiny_dirs):
    address, kv_address = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
    proc = kvserve("up", "--model", str(tiny_dirs["tiny"]), "--listen", address, "--kvcache-listen", kv_address,
                   *MODEL_FLAGS, "--log-level", "warning")
    kids: list[int] = []
    try:
        wait_serving(address, proc)
        wait_serving(kv_address, proc)
        kids = children(proc.pid)
        yield proc, address, kv_address
    finally:
        kids += children(proc.pid)
        terminate(proc)
        stop_pids(kids)


@pytest.fixture(scope="module")
def undisturbed(up):
    _, address, _ = up
    recorded = streams(address)
    finish(recorded)
    assert all(r.code == grpc.StatusCode.OK and len(r.tokens) == NEW_TOKENS for r in recorded)
    return [r.tokens for r in recorded]


def test_kill_9_the_manager_three_times_changes_no_token(up, undisturbed):
    proc, address, kv_address = up
    recorded = streams(address)
    manager = None
    for kill in range(1, 4):
        # the client's count lags what the server sent, so a stream can seem to advance while the
        # manager is down: wait for the restarted manager itself before counting
        manager = pid_of(proc.pid, "kvcache", other_than=manager)
        wait_serving(kv_address, proc)
        since = [len(r.tokens) for r in recorded]
        wait_until(lambda: all_advanced(recorded, since, 5), timeout=60, what="every stream to advance")
        assert not all(r.done.is_set() for r in recorded), f"every stream ended before kill {kill}"
        os.kill(manager, signal.SIGKILL)
        wait_until(lambda: not alive(manager), what="the manager to die")
    finish(recorded)
    for i, (r, tokens) in enumerate(zip(recorded, undisturbed)):
        assert r.code == grpc.StatusCode.OK, f"stream {i}: {r.code} {r.details}"
        assert r.tokens == tokens, f"stream {i}: the restarts changed its tokens"
    wait_until(lambda: kv_stats(kv_address).used_pages == 0, what="used_pages == 0")
    assert kv_stats(kv_address).num_sequences == 0
    assert proc.poll() is None


def test_a_stale_epochs_register_is_refused_and_the_live_state_is_intact(up, undisturbed):
    _, address, kv_address = up
    live = kv_stats(kv_address).epoch
    with grpc.insecure_channel(kv_address) as ch:
        err = rpc_error(lambda: kv_pb_grpc.KVCacheManagerStub(ch).Register(
            kv_pb.RegisterRequest(epoch=1, page_size=4, num_pages=2048), timeout=5))
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION and "older than the live epoch" in err.details()
    assert kv_stats(kv_address).epoch == live
    with grpc.insecure_channel(address) as ch:
        out = generate(pb_grpc.InferenceStub(ch), request(token_ids=PROMPTS[0], **greedy(NEW_TOKENS)))
    assert out.tokens == undisturbed[0]


def test_kill_9_the_model_service_and_up_starts_it_again(up, undisturbed):
    proc, address, kv_address = up
    old_epoch = kv_stats(kv_address).epoch
    recorded = streams(address, max_tokens=1800)   # long enough to be in flight at the kill
    wait_until(lambda: all(r.tokens for r in recorded), timeout=60, what="every stream's first token")
    model = pid_of(proc.pid, "model")
    os.kill(model, signal.SIGKILL)
    finish(recorded)   # its clients see the connection go: UNAVAILABLE, never a hang
    assert all(r.code == grpc.StatusCode.UNAVAILABLE for r in recorded), [r.code for r in recorded]
    wait_serving(address, proc)
    wait_until(lambda: kv_stats(kv_address).epoch != old_epoch, what="the new model service's epoch")
    with grpc.insecure_channel(address) as ch:
        out = generate(pb_grpc.InferenceStub(ch), request(token_ids=PROMPTS[3], **greedy(NEW_TOKENS)))
    assert out.tokens == undisturbed[3]
    wait_until(lambda: kv_stats(kv_address).used_pages == 0, what="used_pages == 0")


@contextlib.contextmanager
def own_up(tiny_dirs, *flags: str):
    """A `kvserve up` of the test's own, stderr captured: (process, address, its children)."""
    address = f"127.0.0.1:{free_port()}"
    proc = kvserve("up", "--model", str(tiny_dirs["tiny"]), "--listen", address,
                   "--kvcache-listen", f"127.0.0.1:{free_port()}", *flags, *MODEL_FLAGS,
                   "--log-level", "warning", stderr=subprocess.PIPE, text=True)
    kids: list[int] = []
    try:
        wait_serving(address, proc)
        kids += children(proc.pid)
        yield proc, address, kids
    finally:
        terminate(proc)
        stop_pids(kids + children(proc.pid))


def test_sigterm_to_up_drains_the_model_service_while_the_manager_still_serves(tiny_dirs):
    with own_up(tiny_dirs, "--grace-period", "1") as (proc, address, kids):
        recorded = streams(address, max_tokens=1800)
        wait_until(lambda: all(r.tokens for r in recorded), timeout=60, what="every stream's first token")
        proc.send_signal(signal.SIGTERM)
        finish(recorded, timeout=30)
        # ended by the drain, with the manager still there: not by a lost manager
        for r in recorded:
            assert (r.code, r.details) == (grpc.StatusCode.UNAVAILABLE, "the server shut down before the request "
                                           "finished (it was given 1 s to finish)"), (r.code, r.details)
        assert proc.wait(30) == 0
        stderr = proc.stderr.read()
        assert "lost the KV-cache manager" not in stderr, stderr
        wait_until(lambda: not any(alive(p) for p in kids), what="the children to stop")


def test_up_stops_the_stack_when_a_child_exits_too_often(tiny_dirs):
    with own_up(tiny_dirs, "--max-restarts", "1") as (proc, address, kids):
        for _ in range(2):
            manager = pid_of(proc.pid, "kvcache")
            os.kill(manager, signal.SIGKILL)
            wait_until(lambda: not alive(manager), what="the manager to die")
            if proc.poll() is None:
                wait_until(lambda: proc.poll() is not None or any(
                    p != manager for p in running(proc.pid, "kvcache")), timeout=30, what="a restart or an exit")
        assert proc.wait(30) == 1
        stderr = proc.stderr.read()
        assert "the KV-cache manager was killed by SIGKILL; starting it again" in stderr, stderr
        assert "2 exits within a minute, more than --max-restarts 1 allows" in stderr, stderr
        wait_until(lambda: not any(alive(p) for p in kids), what="the children to stop")


# ------------------------------------------------------------------- started apart


class Apart:
    """`kvserve kvcache` and `kvserve model` as separate processes, so the test decides when
    (and whether) the manager comes back."""

    def __init__(self, model, **flags) -> None:
        self.kv_address, self.address = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
        self.model_path = model
        self.manager = self.start_manager()
        wait_serving(self.kv_address, self.manager)
        extra = [f"--{k.replace('_', '-')}={v}" for k, v in flags.items()]
        self.model = kvserve("model", "--model", str(model), "--listen", self.address, "--kvcache", self.kv_address,
                             *MODEL_FLAGS, *extra, "--log-level", "warning")
        wait_serving(self.address, self.model)

    def start_manager(self) -> subprocess.Popen:
        return kvserve("kvcache", "--listen", self.kv_address, "--num-pages", "2048", "--page-size", "4",
                       "--log-level", "warning")

    def close(self) -> None:
        terminate(self.model)
        terminate(self.manager)


@pytest.fixture
def apart(tiny_dirs, request):
    a = Apart(tiny_dirs["tiny"], **request.param)
    try:
        yield a
    finally:
        a.close()


# A 2 s stop stays within the default --manager-timeout (5 s); --stall-timeout 1 shows in health.
@pytest.mark.parametrize("apart", [dict(stall_timeout=1)], indirect=True)

def test_sigstop_the_manager_for_2_s_pauses_the_streams_and_changes_no_token(apart):
    quiet = streams(apart.address)
    finish(quiet)
    health = HealthLog(apart.address)
    try:
        recorded = streams(apart.address)
        since = [0] * len(recorded)
        wait_until(lambda: all_advanced(recorded, since, 5), timeout=60, what="every stream to advance")
        apart.manager.send_signal(signal.SIGSTOP)
        try:
            # --stall-timeout 1: the stalled engine turns health NOT_SERVING while it waits
            wait_until(lambda: health_pb2.HealthCheckResponse.NOT_SERVING in health.statuses, timeout=10,
                       what="NOT_SERVING during the stop")
            # a stopped manager is not cured by restarting the model service: liveness holds
            assert health_of(apart.address, "liveness") == health_pb2.HealthCheckResponse.SERVING
            stopped_at = time.monotonic()
            wait_until(lambda: time.monotonic() - stopped_at > 1.0, what="the rest of the 2 s")
        finally:
            apart.manager.send_signal(signal.SIGCONT)
        finish(recorded)
        assert [r.code for r in recorded] == [grpc.StatusCode.OK] * len(recorded)
        assert [r.tokens for r in recorded] == [r.tokens for r in quiet]
        wait_until(lambda: health.statuses[-1] == health_pb2.HealthCheckResponse.SERVING, what="SERVING again")
        wait_until(lambda: kv_stats(apart.kv_address).used_pages == 0, what="used_pages == 0")
    finally:
        health.close()


@pytest.mark.parametrize("apart", [dict(manager_timeout=2)], indirect=True)
def test_a_manager_gone_past_the_timeout_ends_every_stream_unavailable(apart):
    recorded = streams(apart.address, max_tokens=1500)
    wait_until(lambda: all(r.tokens for r in recorded), timeout=60, what="every stream's first token")
    apart.manager.kill()
    apart.manager.wait()
    finish(recorded, timeout=30)   # --manager-timeout 2: they end, they do not hang
    for r in recorded:
        assert r.code == grpc.StatusCode.UNAVAILABLE, (r.code, r.details)
        assert "KV-cache manager" in r.details and "unreachable" in r.details, r.details
    assert health_of(apart.address) == health_pb2.HealthCheckResponse.NOT_SERVING
    with grpc.insecure_channel(apart.address) as ch:
        stub = pb_grpc.InferenceStub(ch)
        err = rpc_error(lambda: stub.Generate(request(token_ids=PROMPTS[0], **greedy(4)), timeout=10))
        assert err.code() == grpc.StatusCode.UNAVAILABLE and "unreachable" in err.details()
        apart.manager = apart.start_manager()   # back, empty: the engine registers again
        wait_serving(apart.address, apart.model)
        out = generate(stub, request(token_ids=PROMPTS[0], **greedy(8)))
        assert len(out.tokens) == 8
        stats = stub.GetServerStats(pb.GetServerStatsRequest(), timeout=10)
        assert stats.manager_reachable and stats.requests_failed == len(recorded)
    wait_until(lambda: kv_stats(apart.kv_address).used_pages == 0, what="used_pages == 0")
