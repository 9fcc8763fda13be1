"""The event log keeps only what its readers have not read, and every event carries its epoch."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve.kvcache_service.contract.types import Admit, CacheReset, Commit, PagesStored, StepRequest
from kvserve.kvcache_service.core import ManagerConfig
from kvserve.kvcache_service.core.events import EventLog
from kvserve.kvcache_service.core.manager import KVCacheManager


def test_with_no_reader_nothing_is_kept_and_numbers_still_rise():
    log = EventLog()
    for i in range(100):
        log.stored(0, [i + 1])
    assert len(log) == 0 and log.last == 100
    reader = log.open()
    assert log.read(reader) == []
    log.stored(0, [7])
    assert log.read(reader) == [PagesStored(101, 0, (7,), 0)]
    assert len(log) == 0   # read by its only reader


def test_an_event_stays_until_the_slowest_reader_has_read_it():
    log = EventLog()
    fast, slow = log.open(), log.open()
    log.stored(0, [1])
    log.stored(1, [2])
    assert [e.number for e in log.read(fast)] == [1, 2]
    assert len(log) == 2
    log.evicted([2])
    assert [e.number for e in log.read(slow)] == [1, 2, 3]
    assert len(log) == 1   # 3: fast has not read it
    log.close(fast)
    assert len(log) == 0


def test_a_reader_past_the_capacity_sees_a_gap():
    log = EventLog(capacity=3)
    reader = log.open()
    for i in range(5):
        log.stored(0, [i + 1])
    assert [e.number for e in log.read(reader)] == [3, 4, 5]


def test_a_reader_past_the_hashes_kept_sees_a_gap_and_one_large_event_is_still_kept():
    """Bounded in page hashes too: one event may carry a hash per page of the pool, so a reader
    that reads nothing could otherwise pin 65,536 events of thousands of hashes each."""
    log = EventLog(capacity=1000, max_hashes=10)
    reader = log.open()
    for i in range(4):
        log.stored(0, [10 * i + k for k in range(4)])   # 16 hashes in all
    assert [e.number for e in log.read(reader)] == [3, 4]
    log.evicted(list(range(25)))   # larger than the bound alone: kept, and only it
    log.stored(0, [1])
    assert [e.number for e in log.read(reader)] == [6]
    log.evicted(list(range(25)))
    assert [e.number for e in log.read(reader)] == [7]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["event", "read", "open", "close"]), st.integers(0, 3)), max_size=80))
def test_every_reader_reads_every_kept_event_once_in_order(ops):
    log = EventLog(capacity=1000)
    readers: dict[int, int] = {}        # reader -> last number it read
    opened_at: dict[int, int] = {}
    for op, which in ops:
        live = sorted(readers)
        if op == "event":
            log.stored(0, [log.last + 1])
        elif op == "open":
            r = log.open()
            readers[r], opened_at[r] = log.last, log.last
        elif op == "close" and live:
            log.close(live[which % len(live)])
            readers.pop(live[which % len(live)])
        elif op == "read" and live:
            r = live[which % len(live)]
            got = [e.number for e in log.read(r)]
            assert got == list(range(readers[r] + 1, log.last + 1))
            readers[r] = log.last
        kept_from = min(readers.values(), default=log.last) + 1
        assert len(log) == log.last - kept_from + 1


def test_events_and_snapshots_carry_the_epoch_and_a_reset_the_new_one():
    m = KVCacheManager(ManagerConfig(num_pages=16, page_size=4, max_seqs=8))
    m.register(3, 4, 16)
    reader = m.events.open()
    m.step(StepRequest(epoch=3, needs=[Admit("a", list(range(9)), "")]))
    m.step(StepRequest(epoch=3, commits=[Commit(0, 8)]))
    assert m.snapshot().epoch == 3
    m.register(4, 4, 16)
    events = m.events.read(reader)
    assert [type(e).__name__ for e in events] == ["PagesStored", "CacheReset"]
    assert events[0].epoch == 3 and events[1] == CacheReset(events[0].number + 1, 4)
    assert m.snapshot().epoch == 4
