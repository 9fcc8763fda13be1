"""WatchEvents: stored, evicted and reset events, numbered without gaps, and snapshots.

Hashes are checked against kvcache_service.core.hashing.page_hashes, the
byte-exact spec in kvcache.proto.
"""

from __future__ import annotations

import grpc

from kvserve.kvcache_service.core import ManagerConfig
from kvserve.kvcache_service.contract.hashing import page_hashes
from kvserve.kvcache.v1 import kvcache_pb2 as pb
from tests.kvcache.conftest import KV, admit, commit
from tests.service.util import wait_until

T10 = list(range(100, 110))


class Watch:
    """One WatchEvents stream; next() fails the test instead of hanging."""

    def __init__(self, kv: KV, snapshot: bool) -> None:
        self.call = kv.stub.WatchEvents(pb.WatchEventsRequest(snapshot=snapshot), timeout=10)

    def next(self) -> pb.Event:
        return next(self.call)

    def close(self) -> None:
        self.call.cancel()


def stored(number: int, parent: int, hashes: list[int]) -> pb.Event:
    return pb.Event(number=number, stored=pb.PagesStored(parent_hash=parent, hashes=hashes))


def evicted(number: int, hashes: list[int]) -> pb.Event:
    return pb.Event(number=number, evicted=pb.PagesEvicted(hashes=hashes))


def test_commit_of_full_pages_streams_stored_chains(kv: KV) -> None:
    watch = Watch(kv, snapshot=True)
    try:
        assert watch.next() == pb.Event(number=0, snapshot=pb.Snapshot())  # empty tree; also: subscribed
        h = page_hashes(T10, 4)
        kv.admit("a", T10)
        kv.commit(0, 8)
        assert watch.next() == stored(1, 0, h)
        tokens = T10 + [7, 7]
        kv.commit(0, 12, [7, 7])
        assert watch.next() == stored(2, h[1], page_hashes(tokens, 4)[2:])
        # A second prompt sharing the first page stores only its own chain, under that page.
        other = T10[:4] + [1, 2, 3, 4, 5]
        kv.admit("b", other)
        kv.commit(1, 9)
        assert watch.next() == stored(3, h[0], page_hashes(other, 4)[1:])
        # extra_key salts every hash.
        kv.admit("c", T10[:4], extra_key="tenant-2")
        kv.commit(2, 4)
        assert watch.next() == stored(4, 0, page_hashes(T10[:4], 4, "tenant-2"))
        assert kv.stats().last_event == 4
    finally:
        watch.close()


def test_eviction_streams_evicted_hashes_leaves_first(kv: KV) -> None:
    watch = Watch(kv, snapshot=True)
    try:
        watch.next()
        kv.admit("a", T10)
        kv.commit(0, 10)
        kv.release(seq_id=0)          # pages 1 then 0 parked; page 2 freed
        h = page_hashes(T10, 4)
        assert watch.next() == stored(1, 0, h)
        kv.admit("big", list(range(64)))  # 16 pages: 14 free + 2 evicted, the leaf first
        assert watch.next() == evicted(2, [h[1], h[0]])
        s = kv.stats()
        assert (s.evictions, s.tree_pages, s.cached_pages, s.last_event) == (2, 0, 0, 2)
    finally:
        watch.close()


def test_snapshot_holds_the_tree_parents_first_then_the_stream_goes_on(kv: KV) -> None:
    a, b = T10 + [1, 2], T10[:4] + [9, 9, 9, 9]
    kv.step(needs=[admit("a", a)])
    kv.step(commits=[commit(0, 12)])                    # event 1: three pages
    assert kv.step(needs=[admit("b", b)]).results[0].cached_tokens == 4
    kv.step(commits=[commit(1, 8)])                     # event 2: one page under a's first
    ha, hb = page_hashes(a, 4), page_hashes(b, 4)
    watch = Watch(kv, snapshot=True)
    try:
        first = watch.next()
        assert first.number == 2 and first.WhichOneof("kind") == "snapshot"
        pages = list(zip(first.snapshot.hashes, first.snapshot.parent_hashes))
        assert sorted(pages) == sorted([(ha[0], 0), (ha[1], ha[0]), (ha[2], ha[1]), (hb[1], ha[0])])
        seen = {0}
        for h, parent in pages:  # parents before children
            assert parent in seen
            seen.add(h)
        kv.call("Reset", pb.ResetRequest())
        assert watch.next() == pb.Event(number=3, reset=pb.CacheReset())
    finally:
        watch.close()
    again = Watch(kv, snapshot=True)
    try:
        assert again.next() == pb.Event(number=3, snapshot=pb.Snapshot())
    finally:
        again.close()


def test_numbers_rise_by_one_across_kinds_and_every_subscriber_sees_the_same(kv: KV) -> None:
    watches = [Watch(kv, snapshot=True) for _ in range(2)]
    try:
        for w in watches:
            w.next()
        kv.admit("a", T10)
        kv.commit(0, 10)                                  # 1: stored
        kv.release(seq_id=0)
        kv.admit("big", list(range(60)))                  # 2: evicted
        kv.call("Register", pb.RegisterRequest(epoch=1, page_size=4, num_pages=16))  # 3: reset
        kv.admit("c", T10)
        kv.commit(0, 4)                                   # 4: stored
        kv.call("Reset", pb.ResetRequest())               # 5: reset
        streams = [[w.next() for _ in range(5)] for w in watches]
        assert streams[0] == streams[1]
        assert [e.number for e in streams[0]] == [1, 2, 3, 4, 5]
        assert [e.WhichOneof("kind") for e in streams[0]] == ["stored", "evicted", "reset", "stored", "reset"]
    finally:
        for w in watches:
            w.close()


def test_without_snapshot_only_later_events_are_sent(kv: KV) -> None:
    kv.admit("a", T10)
    kv.commit(0, 8)  # event 1, before subscribing
    watch = Watch(kv, snapshot=False)
    try:
        # no first message says the stream is open: the server's log has its reader once it is
        wait_until(lambda: len(kv.manager.state.events._readers) == 1, timeout=30, what="the stream open")
        kv.commit(0, 12, [1, 2])
        assert watch.next() == stored(2, page_hashes(T10, 4)[1], page_hashes(T10 + [1, 2], 4)[2:])
    finally:
        watch.close()


def test_a_cancelled_watch_leaves_the_server_serving(kv: KV) -> None:
    watch = Watch(kv, snapshot=True)
    watch.next()
    watch.close()
    try:
        watch.next()
        raise AssertionError("a cancelled stream yielded")
    except grpc.RpcError as err:
        assert err.code() == grpc.StatusCode.CANCELLED
    kv.admit("a", T10)
    assert kv.commit(0, 8) == 2
    assert kv.stats().last_event == 1


def test_a_subscriber_that_falls_behind_sees_a_gap_and_resyncs_with_a_snapshot(kv_factory) -> None:
    kv = kv_factory(ManagerConfig(num_pages=16, page_size=4, max_seqs=8, event_capacity=4))
    watch = Watch(kv, snapshot=True)
    try:
        assert watch.next().number == 0
        prompts = [[i] * 4 for i in range(6)]
        kv.step(needs=[admit(f"r{i}", p + [0]) for i, p in enumerate(prompts)])
        kv.step(commits=[commit(i, 4) for i in range(6)])  # six events in one call; four are kept
        got = [watch.next() for _ in range(4)]
        assert [e.number for e in got] == [3, 4, 5, 6]  # 1 and 2 are gone: the gap says so
        assert [list(e.stored.hashes) for e in got] == [page_hashes(p, 4) for p in prompts[2:]]
    finally:
        watch.close()
    again = Watch(kv, snapshot=True)
    try:
        snap = again.next()
        assert snap.number == 6
        assert set(snap.snapshot.hashes) == {page_hashes(p, 4)[0] for p in prompts}
    finally:
        again.close()
