"""Sixteen client threads against one server: admissions, commits and releases of
their own request ids, prompts sharing prefixes, while a subscriber follows the
event stream. Afterwards nothing is leaked, the manager's invariants hold, and
the streamed events rebuild exactly the tree a fresh snapshot reports."""

from __future__ import annotations

import random
import threading

import grpc

from kvserve.kvcache_service.core import ManagerConfig
from kvserve.kvcache.v1 import kvcache_pb2 as pb
from kvserve.kvcache.v1 import kvcache_pb2_grpc as pb_grpc
from tests.kvcache.conftest import admit, commit, grow

from tests.kvcache.invariants import check_invariants

THREADS = 16
ROUNDS = 30
PS = 4
CONFIG = ManagerConfig(num_pages=192, page_size=PS, max_seqs=24, cpu_pages=0)
PREFIXES = [[7] * 8, [7] * 4 + [8] * 4, [9] * 12]  # shared by every thread; two share a page


def prompts(thread: int) -> list[list[int]]:
    """The thread's prompts: a shared prefix, then tokens of its own."""
    rng = random.Random(thread)
    return [rng.choice(PREFIXES) + [1000 + thread, r] + [rng.randrange(50) for _ in range(rng.randrange(8))]
            for r in range(ROUNDS)]


def client(stub: pb_grpc.KVCacheManagerStub, thread: int, errors: list[BaseException]) -> None:
    t = 10.0
    try:
        for r, tokens in enumerate(prompts(thread)):
            rid = f"t{thread}-r{r}"
            n = len(tokens)
            if (thread + r) % 2:  # fine-grained calls
                res = stub.Allocate(pb.AllocateRequest(need=admit(rid, tokens)), timeout=t).result
                assert res.granted and res.replaces_table and res.cached_tokens % PS == 0
                assert res.cached_tokens + res.num_tokens == n
                assert len(res.page_ids) == -(-n // PS)
                stub.Commit(pb.CommitRequest(commit=commit(res.seq_id, n)), timeout=t)
                stub.Allocate(pb.AllocateRequest(need=grow(res.seq_id, n + 5)), timeout=t)
                stub.Commit(pb.CommitRequest(commit=commit(res.seq_id, n + 5, [r] * 5)), timeout=t)
                if r % 3 == 0:
                    stub.MatchPrefix(pb.MatchPrefixRequest(token_ids=tokens), timeout=t)
                ref = pb.SequenceRef(request_id=rid) if r % 4 == 1 else pb.SequenceRef(seq_id=res.seq_id)
                info = stub.GetSequence(pb.GetSequenceRequest(seq=ref), timeout=t)
                assert (info.request_id, info.num_tokens, info.num_computed) == (rid, n + 5, n + 5)
                stub.Release(pb.ReleaseRequest(seq=ref), timeout=t)
            else:  # the engine's round trip
                res = stub.Step(pb.StepRequest(needs=[admit(rid, tokens)]), timeout=t).results[0]
                assert res.granted and res.cached_tokens + res.num_tokens == n
                step = stub.Step(pb.StepRequest(commits=[commit(res.seq_id, n)], needs=[grow(res.seq_id, n + 1)]),
                                 timeout=t)
                assert step.results[0].granted and not step.preempted
                stub.Step(pb.StepRequest(commits=[commit(res.seq_id, n + 1, [r])]), timeout=t)
                stub.Step(pb.StepRequest(releases=[res.seq_id]), timeout=t)
    except BaseException as exc:  # noqa: BLE001 - reported by the main thread
        errors.append(exc)


def follow(call, events: list, subscribed: threading.Event) -> None:
    """Collects a WatchEvents stream until the main thread cancels it."""
    try:
        for event in call:
            events.append(event)
            subscribed.set()
    except grpc.RpcError as err:
        if err.code() != grpc.StatusCode.CANCELLED:
            events.append(err)


def replay(events: list[pb.Event]) -> dict[int, int]:
    """hash -> parent hash, rebuilt the way a router following the stream would."""
    nodes: dict[int, int] = {}
    for e in events:
        kind = e.WhichOneof("kind")
        if kind == "snapshot":
            nodes = dict(zip(e.snapshot.hashes, e.snapshot.parent_hashes))
        elif kind == "stored":
            parent = e.stored.parent_hash
            assert parent == 0 or parent in nodes, f"event {e.number}: stored under an unknown parent"
            for h in e.stored.hashes:
                assert h not in nodes, f"event {e.number}: page stored twice"
                nodes[h] = parent
                parent = h
        elif kind == "evicted":
            for h in e.evicted.hashes:
                del nodes[h]
                assert h not in nodes.values(), f"event {e.number}: evicted a page with children"
        else:
            nodes = {}
    return nodes


def test_sixteen_clients_leave_nothing_behind(kv_factory) -> None:
    kv = kv_factory(CONFIG)
    events: list = []
    subscribed = threading.Event()
    watch = kv.stub.WatchEvents(pb.WatchEventsRequest(snapshot=True), timeout=60)
    follower = threading.Thread(target=follow, args=(watch, events, subscribed), daemon=True)
    follower.start()
    try:
        assert subscribed.wait(5), "WatchEvents sent no snapshot"
        run_clients(kv.address)
        s = kv.stats()
        for _ in range(100):  # the stream may trail the last call a little
            if isinstance(events[-1], pb.Event) and events[-1].number >= s.last_event:
                break
            follower.join(0.05)
    finally:
        watch.cancel()
        follower.join(5)

    assert (s.num_sequences, s.used_pages, s.free_seq_ids, s.num_swapped) == (0, 0, CONFIG.max_seqs, 0)
    assert s.free_pages + s.cached_pages == s.total_pages == CONFIG.num_pages
    assert s.cached_pages == s.tree_pages > 0
    assert s.prefix_query_tokens == sum(len(p) for i in range(THREADS) for p in prompts(i))
    assert 0 < s.prefix_hit_tokens < s.prefix_query_tokens
    assert s.evictions > 0
    assert s.preemptions_recompute == s.preemptions_swap == 0

    # The stream: numbers rise by one up to the last event, and replaying it gives the tree.
    assert all(isinstance(e, pb.Event) for e in events), [e for e in events if not isinstance(e, pb.Event)]
    numbers = [e.number for e in events]
    assert numbers[0] == 0 and events[0].WhichOneof("kind") == "snapshot"
    assert numbers == list(range(len(numbers))) and numbers[-1] == s.last_event
    snap = kv.stub.WatchEvents(pb.WatchEventsRequest(snapshot=True), timeout=5)
    try:
        fresh = next(snap)
    finally:
        snap.cancel()
    assert fresh.number == s.last_event and len(fresh.snapshot.hashes) == s.tree_pages
    assert replay(events) == dict(zip(fresh.snapshot.hashes, fresh.snapshot.parent_hashes))

    check_invariants(kv.manager.state)  # every call has returned: the manager is idle


def run_clients(address: str) -> None:
    """THREADS clients, half on one shared channel, half on channels of their own."""
    shared = grpc.insecure_channel(address)
    own = [grpc.insecure_channel(address) for _ in range(THREADS // 2)]
    stubs = [pb_grpc.KVCacheManagerStub(own[i // 2] if i % 2 else shared) for i in range(THREADS)]
    errors: list[BaseException] = []
    threads = [threading.Thread(target=client, args=(stubs[i], i, errors)) for i in range(THREADS)]
    try:
        for th in threads:
            th.start()
        for th in threads:
            th.join(60)
        assert not any(th.is_alive() for th in threads), "a client thread hung"
    finally:
        for ch in [shared, *own]:
            ch.close()
    assert not errors, errors[0]
