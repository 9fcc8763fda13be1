"""A worker killed -9, or frozen (SIGSTOP), under `kvserve up --workers 2` while greedy streams
run through the gateway: every stream finishes with the tokens of an undisturbed run, none
repeated or missing, the streams of the lost worker going on on the other one. Seeded requests
of n = 3 sequences too: each sequence goes on from its own tokens."""

from __future__ import annotations

import os
import random
import signal
import threading

import grpc
import pytest

from kvserve.inference.v1 import inference_pb2 as pb
from kvserve.inference.v1 import inference_pb2_grpc as pb_grpc
from tests.service.processes import alive, children, free_port, kvserve, stop_pids, terminate, wait_serving
from tests.service.util import greedy, request, wait_until

pytestmark = pytest.mark.slow

_rng = random.Random(5)
PROMPTS = [[_rng.randrange(3, 1024) for _ in range(n)] for n in (9, 17, 23, 31, 38, 44, 52, 61)]
NEW_TOKENS = 600   # long enough that the victim's streams are still running at the kill


class Recorded:
    def __init__(self, address: str, prompt: list[int], **sampling) -> None:
        self.events: list[pb.GenerateResponse] = []
        self.code = None
        self.done = threading.Event()
        sampling = sampling or greedy(NEW_TOKENS)
        threading.Thread(target=self._run, args=(address, request(token_ids=prompt, **sampling)), daemon=True).start()

    def _run(self, address: str, msg: pb.GenerateRequest) -> None:
        with grpc.insecure_channel(address) as ch:
            try:
                for e in pb_grpc.InferenceStub(ch).Generate(msg, timeout=120):
                    self.events.append(e)
                self.code = grpc.StatusCode.OK
            except grpc.RpcError as exc:
                self.code = exc.code(), exc.details()
        self.done.set()

    @property
    def tokens(self) -> list[int]:
        return [t for e in self.events if e.HasField("chunk") for t in e.chunk.token_ids]

    def kinds(self) -> list[str]:
        return [e.WhichOneof("event") for e in self.events]

    def by_index(self) -> dict[int, list[int]]:
        out: dict[int, list[int]] = {}
        for e in self.events:
            if e.HasField("chunk"):
                out.setdefault(e.index, []).extend(e.chunk.token_ids)
        return out


@pytest.fixture(scope="module")
def fleet(tiny_dirs):
    address = f"127.0.0.1:{free_port()}"
    proc = kvserve("up", "--model", str(tiny_dirs["tiny"]), "--workers", "2", "--listen", address,
                   "--device", "cpu", "--dtype", "float32", "--page-size", "4", "--num-pages", "2048",
                   "--log-level", "warning")
    kids: list[int] = []
    try:
        wait_serving(address, proc)
        with grpc.insecure_channel(address) as ch:   # both workers seen serving
            stub = pb_grpc.InferenceStub(ch)
            wait_until(lambda: sum(w.state == "serving" for w in stub.GetServerStats(
                pb.GetServerStatsRequest(), timeout=5).workers) == 2, timeout=60, what="two workers serving")
        kids = children(proc.pid)
        yield proc, address
    finally:
        kids += children(proc.pid)
        terminate(proc)
        stop_pids(kids)


def model_services(up_pid: int) -> list[int]:
    out = []
    for pid in children(up_pid):
        argv = open(f"/proc/{pid}/cmdline", "rb").read().split(b"\0")
        if b"model" in argv and alive(pid):
            out.append(pid)
    return out


def test_kill_9_a_worker_and_its_streams_go_on_elsewhere_with_the_same_tokens(fleet):
    proc, address = fleet
    quiet = [Recorded(address, p) for p in PROMPTS]
    for r in quiet:
        assert r.done.wait(120) and r.code == grpc.StatusCode.OK, r.code
    hurt = [Recorded(address, p) for p in PROMPTS]
    wait_until(lambda: all(len(r.tokens) >= 20 for r in hurt), timeout=60, what="every stream under way")
    assert not all(r.done.is_set() for r in hurt), "every stream ended before the kill"
    victim = model_services(proc.pid)[0]
    os.kill(victim, signal.SIGKILL)
    for r in hurt:
        assert r.done.wait(120), "a stream hung"
    for q, h in zip(quiet, hurt):
        assert h.code == grpc.StatusCode.OK, h.code
        assert h.tokens == q.tokens   # nothing repeated, nothing missing
        kinds = h.kinds()
        assert kinds.count("prefill_done") == 1 and kinds.count("finished") == 1 and "queued" not in kinds
        assert h.events[-1].finished.usage.completion_tokens == NEW_TOKENS
        # the usage's cache hit is the one prefill_done told, never more than the prompt
        usage, prefill = h.events[-1].finished.usage, next(e.prefill_done for e in h.events
                                                            if e.HasField("prefill_done"))
        assert usage.cached_tokens == prefill.cached_tokens <= usage.prompt_tokens
    with grpc.insecure_channel(address) as ch:
        stub = pb_grpc.InferenceStub(ch)
        stats = stub.GetServerStats(pb.GetServerStatsRequest(), timeout=10)
        assert sum(w.migrated_away for w in stats.workers) >= 1, stats
        # the moved streams' prefills were counted at each worker, and no longer are
        wait_until(lambda: all(w.prefill_tokens == 0 for w in stub.GetServerStats(
            pb.GetServerStatsRequest(), timeout=10).workers), what="no prefill left ahead anywhere")


def test_kill_9_a_worker_and_its_seeded_n_3_streams_go_on_elsewhere_sequence_by_sequence(fleet):
    """A request of three sampled sequences splits at the move into one request per sequence,
    each with its own tokens and seed: every sequence's tokens are those of an undisturbed run."""
    proc, address = fleet
    wait_until(lambda: serving_workers(address) == 2, timeout=120, what="two workers serving")
    sampling = [dict(n=3, seed=11 + k, temperature=1.0, top_k=50, max_tokens=NEW_TOKENS, ignore_eos=True)
                for k in range(4)]
    quiet = [Recorded(address, p, **s) for p, s in zip(PROMPTS[:4], sampling)]
    for r in quiet:
        assert r.done.wait(120) and r.code == grpc.StatusCode.OK, r.code
    before = routed(address)
    hurt = [Recorded(address, p, **s) for p, s in zip(PROMPTS[:4], sampling)]
    wait_until(lambda: all(min(map(len, r.by_index().values()), default=0) >= 10 and len(r.by_index()) == 3
                           for r in hurt), timeout=60, what="every sequence under way")
    moved_before = migrated(address)
    victim = busy_model_service(proc.pid, address, before)
    os.kill(victim, signal.SIGKILL)
    for r in hurt:
        assert r.done.wait(120), "a stream hung"
    for q, h in zip(quiet, hurt):
        assert h.code == grpc.StatusCode.OK, h.code
        assert h.by_index() == q.by_index()   # each sequence: nothing repeated, nothing missing
        kinds = h.kinds()
        assert kinds.count("prefill_done") == 1 and kinds.count("finished") == 3
        assert sorted(e.index for e in h.events if e.HasField("finished")) == [0, 1, 2]
        assert all(e.finished.usage.completion_tokens == NEW_TOKENS for e in h.events if e.HasField("finished"))
    assert migrated(address) > moved_before


def serving_workers(address: str) -> int:
    with grpc.insecure_channel(address) as ch:
        stats = pb_grpc.InferenceStub(ch).GetServerStats(pb.GetServerStatsRequest(), timeout=10)
    return sum(w.state == "serving" for w in stats.workers)


def migrated(address: str) -> int:
    with grpc.insecure_channel(address) as ch:
        stats = pb_grpc.InferenceStub(ch).GetServerStats(pb.GetServerStatsRequest(), timeout=10)
    return sum(w.migrated_away for w in stats.workers)


def routed(address: str) -> dict[str, int]:
    with grpc.insecure_channel(address) as ch:
        stats = pb_grpc.InferenceStub(ch).GetServerStats(pb.GetServerStatsRequest(), timeout=10)
    return {w.address: w.requests_routed for w in stats.workers}


def busy_model_service(up_pid: int, address: str, routed_before: dict[str, int]) -> int:
    """The pid of the worker the gateway sent most of the streams started since `routed_before`
    to. (Not one whose load report says it runs some: a report is a moment behind, and a worker
    that had just finished the undisturbed run could still say so.)"""
    now = routed(address)
    busy = max(now, key=lambda a: now[a] - routed_before.get(a, 0))
    assert now[busy] > routed_before.get(busy, 0), (routed_before, now)
    for pid in model_services(up_pid):
        if busy.encode() in open(f"/proc/{pid}/cmdline", "rb").read():
            return pid
    raise AssertionError(f"no model service listens on {busy}")


def test_a_frozen_worker_is_left_and_its_streams_go_on_elsewhere_with_the_same_tokens(fleet):
    """SIGSTOP keeps the worker's sockets open and answers nothing: no connection error tells
    the gateway, only the silence of its load reports."""
    proc, address = fleet
    wait_until(lambda: serving_workers(address) == 2, timeout=120, what="two workers serving")
    prompts = PROMPTS[:4]
    quiet = [Recorded(address, p) for p in prompts]
    for r in quiet:
        assert r.done.wait(120) and r.code == grpc.StatusCode.OK, r.code
    moved_before, before = migrated(address), routed(address)
    hurt = [Recorded(address, p) for p in prompts]
    wait_until(lambda: all(len(r.tokens) >= 20 for r in hurt), timeout=60, what="every stream under way")
    victim = busy_model_service(proc.pid, address, before)
    os.kill(victim, signal.SIGSTOP)
    try:
        for r in hurt:
            assert r.done.wait(120), "a stream hung on the frozen worker"
    finally:
        os.kill(victim, signal.SIGCONT)
    for q, h in zip(quiet, hurt):
        assert h.code == grpc.StatusCode.OK, h.code
        assert h.tokens == q.tokens
        assert h.kinds().count("finished") == 1
    assert migrated(address) > moved_before
