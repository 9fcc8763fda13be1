"""Eviction order: leaves first, least recently used first.

A small pool is kept under pressure by many distinct prompts, so most calls
evict. An independent model keeps each tree page's last use: the index of the
last call after which a live sequence referenced it. Every eviction must take
a page no more recently used than any parked page it leaves behind, in
non-decreasing order of last use within a call, and (from the event stream
alone) a page that has no children left in the tree.
"""

from __future__ import annotations

from collections import Counter

from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from kvserve.kvcache_service.core import (
    Admit,
    Commit,
    Fork,
    Grow,
    KVCacheManager,
    ManagerConfig,
    ResourceExhausted,
    Resume,
    StepRequest,
)
from kvserve.kvcache_service.core.sequence import SWAPPED_OUT
from kvserve.kvcache_service.contract.types import SeqState
from tests.kvcache.invariants import EventMirror, check_invariants

TOKEN = st.integers(0, 3)


class Driver:
    def __init__(self, m: KVCacheManager, data) -> None:
        self.m, self.data = m, data
        self.calls = 0
        self.last_use: dict[int, int] = {}  # page hash -> last call it was referenced after
        self.mirror = EventMirror()
        self.rid = 0
        self.stats: Counter[str] = Counter()
        self._observe()

    # -------------------------------------------------------------- model

    def _referenced_hashes(self) -> set[int]:
        tree = self.m.state.tree
        return {tree.hash_of[p] for s in self.m.state.seqs.values() for p in s.pages
                if p != SWAPPED_OUT and tree.is_node(p)}

    def _parked_hashes(self) -> set[int]:
        return set(self.m.state.tree.page_of) - self._referenced_hashes()

    def _observe(self) -> None:
        for h in self._referenced_hashes():
            self.last_use[h] = self.calls

    def call(self, fn, *args):
        """One public call, checked: evictions are LRU among the parked pages."""
        parked_before = self._parked_hashes()
        self.calls += 1
        try:
            return fn(*args)
        finally:
            check_invariants(self.m.state)
            evicted = self.mirror.sync(self.m.state)
            after_parked = self._parked_hashes()
            remaining = parked_before & after_parked
            uses = []
            for h in evicted:
                assert h in self.last_use, f"evicted page {h:#x} was never referenced"
                use = self.last_use[h]
                uses.append(use)
                older = [r for r in remaining if self.last_use[r] < use]
                assert not older, (
                    f"call {self.calls}: evicted a page last used at call {use} while "
                    f"{len(older)} parked pages last used earlier (e.g. at call "
                    f"{min(self.last_use[r] for r in older)}) stay cached")
                if remaining:
                    self.stats["evictions with survivors"] += 1
            assert uses == sorted(uses), f"call {self.calls}: evictions out of LRU order {uses}"
            self.stats["evictions"] += len(evicted)
            self._observe()

    # -------------------------------------------------------- operations

    def _prompt(self) -> list[int]:
        d = self.data
        prefix = d.draw(st.sampled_from([[], [0, 1, 2, 3, 0, 1], [3, 3, 2, 2]]), label="prefix")
        return prefix + d.draw(st.lists(TOKEN, min_size=1, max_size=8), label="suffix")

    def _new_rid(self) -> str:
        self.rid += 1
        return f"r{self.rid}"

    def _running(self):
        return [s for s in self.m.state.seqs.values() if s.state is SeqState.RUNNING]

    def _compute_all(self, seq) -> None:
        """The model computes every token it has slots for, samples one more."""
        n = min(len(seq.tokens), len(seq.pages) * self.m.page_size)
        tail = [self.data.draw(TOKEN, label="sampled")] if n == len(seq.tokens) else []
        self.call(self.m.commit, Commit(seq.seq_id, n, tail))

    def admit(self) -> None:
        need = Admit(self._new_rid(), self._prompt())
        if not self.m.can_allocate(need).ok:
            self.release()
            return
        res, _, _ = self.call(self.m.allocate, need)
        self._compute_all(self.m.state.seqs[res.seq_id])

    def admit_in_step(self) -> None:
        """A Step that releases some and admits some (no Grow, so no preemption)."""
        d, m = self.data, self.m
        ids = sorted(m.state.seqs)
        releases = d.draw(st.lists(st.sampled_from(ids), unique=True, max_size=2)) if ids else []
        needs = [Admit(self._new_rid(), self._prompt()) for _ in range(d.draw(st.integers(1, 2)))]
        plan = self.call(m.step, StepRequest(m.epoch, releases=releases, needs=needs))
        for res in plan.results:
            if res.granted:
                self._compute_all(m.state.seqs[res.seq_id])

    def grow(self) -> None:
        running = self._running()
        if not running:
            return
        seq = self.data.draw(st.sampled_from(running), label="grow")
        need = Grow(seq.seq_id, len(seq.tokens) + self.data.draw(st.integers(0, 4)))
        if self.m.can_allocate(need).ok:
            self.call(self.m.allocate, need)
            self._compute_all(seq)

    def release(self) -> None:
        if self.m.state.seqs:
            seq = self.data.draw(st.sampled_from(sorted(self.m.state.seqs)), label="release")
            self.call(self.m.release, seq)

    def truncate(self) -> None:
        running = [s for s in self._running() if len(s.tokens) >= 2]
        if not running:
            return
        seq = self.data.draw(st.sampled_from(running), label="truncate")
        try:
            self.call(self.m.truncate, seq.seq_id, self.data.draw(st.integers(1, len(seq.tokens) - 1)))
        except ResourceExhausted:
            pass

    def fork(self) -> None:
        running = self._running()
        if running:
            parent = self.data.draw(st.sampled_from(running), label="fork")
            if self.m.can_allocate(need := Fork(parent.seq_id, self._new_rid())).ok:
                self.call(self.m.allocate, need)

    def swap(self) -> None:
        m = self.m
        swapped = [s for s in m.state.seqs.values() if s.state is SeqState.SWAPPED]
        if swapped and self.data.draw(st.booleans()):
            seq = self.data.draw(st.sampled_from(swapped), label="swap in")
            if m.can_allocate(Resume(seq.seq_id)).ok:
                self.call(m.allocate, Resume(seq.seq_id))
            return
        running = self._running()
        if running:
            seq = self.data.draw(st.sampled_from(running), label="swap out")
            try:
                self.call(m.swap_out, seq.seq_id)
            except ResourceExhausted:
                pass


OPS = ["admit", "admit", "admit", "admit_in_step", "grow", "release", "release", "truncate",
       "fork", "swap"]


def test_evictions_take_lru_leaves():
    totals: Counter[str] = Counter()

    @settings(max_examples=60, deadline=None, database=None,
              phases=[Phase.explicit, Phase.generate, Phase.shrink],
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(num_pages=st.integers(5, 12), page_size=st.sampled_from([1, 2]),
           cpu_pages=st.integers(0, 8), data=st.data())
    def run(num_pages, page_size, cpu_pages, data):
        m = KVCacheManager(ManagerConfig(num_pages=num_pages, page_size=page_size, max_seqs=6,
                                         cpu_pages=cpu_pages))
        drv = Driver(m, data)
        for _ in range(data.draw(st.integers(10, 60), label="ops")):
            getattr(drv, data.draw(st.sampled_from(OPS), label="op"))()
        for sid in sorted(m.state.seqs):  # all released: nothing referenced, everything cached is evictable
            drv.call(m.release, sid)
        assert m.stats().used_pages == 0
        assert m.stats().cached_pages == m.stats().tree_pages
        totals.update(drv.stats)

    run()
    print("eviction coverage:", dict(totals))
    assert totals["evictions"] >= 200, f"the pool was not under pressure: {dict(totals)}"
    assert totals["evictions with survivors"] >= 50, dict(totals)
