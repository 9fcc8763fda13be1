"""ManagerState: everything the manager knows, and the page mechanics every operation shares.

A device page is in exactly one of three states: free (refcount 0, in the pool's free list),
referenced (refcount > 0: in the page table of a live sequence, once per table), or parked
(refcount 0 but a prefix-tree node: cached, evictable). Three verbs move pages between them:

    take(n)      free -> referenced; evicts parked leaves, least recently parked first, when
                 the free list is short (the caller checked fits()); grow(seq, n) takes what
                 a sequence lacks for n slots
    hold(page)   one more reference (a prefix hit, a fork); a parked page is unparked
    drop(page)   one reference fewer; at 0 a tree node parks, any other page is freed

What an operation costs is a Cost; fits(cost) is the one capacity check, used by Step and by
can_allocate alike. The operations themselves live beside this file, one noun each
(admission, commit, release, swap, ...); the policy that orders them is step.py.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvserve.kvcache_service.contract.errors import FailedPrecondition, NotFound, shown
from kvserve.kvcache_service.contract.types import SeqState, Stats
from kvserve.kvcache_service.core.config import ManagerConfig
from kvserve.kvcache_service.core.events import EventLog
from kvserve.kvcache_service.core.page_pool import CpuPool, PagePool
from kvserve.kvcache_service.core.prefix_tree import PrefixTree
from kvserve.kvcache_service.core.seq_ids import SeqIdPool
from kvserve.kvcache_service.core.sequence import Sequence


@dataclass(slots=True)
class Cost:
    """What serving one need takes. `parked_hits` are cached pages the need will
    reference: they stop being evictable, so they do not count as available."""
    pages: int
    parked_hits: int = 0
    seq_ids: int = 0


@dataclass(slots=True)
class Counters:
    """Run from start-up, through resets (like any monitoring counter)."""
    prefix_query_tokens: int = 0
    prefix_hit_tokens: int = 0
    evictions: int = 0
    preemptions_recompute: int = 0
    preemptions_swap: int = 0


class ManagerState:
    __slots__ = ("page_size", "pool", "cpu", "tree", "seq_ids", "events", "seqs",
                 "by_request", "running", "swapped", "pending_seq_ids", "counters", "epoch")

    def __init__(self, config: ManagerConfig) -> None:
        self.page_size = config.page_size
        self.pool = PagePool(config.num_pages)
        self.cpu = CpuPool(config.cpu_pages)
        self.tree = PrefixTree(config.num_pages)
        self.seq_ids = SeqIdPool(config.max_seqs)
        self.events = EventLog(config.event_capacity)
        self.seqs: dict[int, Sequence] = {}
        self.by_request: dict[str, int] = {}
        self.running: dict[int, None] = {}    # running order: admitted / resumed / forked, oldest first
        self.swapped: dict[int, None] = {}    # swap-out order, earliest first
        self.pending_seq_ids: list[int] = []  # freed by preemption; reusable after the step
        self.counters = Counters()
        self.epoch = 0

    # --------------------------------------------------------------- lookup

    def resolve(self, seq_id: int) -> Sequence:
        seq = self.seqs.get(seq_id)
        if seq is None:
            raise NotFound(f"unknown seq id {seq_id}")
        return seq

    def seq_id_of(self, request_id: str) -> int:
        seq_id = self.by_request.get(request_id)
        if seq_id is None:
            raise NotFound(f"unknown request id {shown(request_id)}")
        return seq_id

    def running_seq(self, seq_id: int) -> Sequence:
        seq = self.resolve(seq_id)
        if seq.state is not SeqState.RUNNING:
            raise FailedPrecondition(f"seq id {seq_id} is swapped out; resume it first")
        return seq

    def swapped_seq(self, seq_id: int) -> Sequence:
        seq = self.resolve(seq_id)
        if seq.state is not SeqState.SWAPPED:
            raise FailedPrecondition(f"seq id {seq_id} is not swapped out")
        return seq

    # ------------------------------------------------------------- capacity

    def available(self) -> int:
        """Pages an allocation can have: free plus parked (evictable)."""
        return len(self.pool.free) + self.tree.num_evictable

    def fits(self, cost: Cost) -> bool:
        return cost.pages <= self.available() - cost.parked_hits and cost.seq_ids <= len(self.seq_ids)

    def shortage(self, cost: Cost) -> str:
        """Why `cost` does not fit, for a person."""
        if cost.seq_ids > len(self.seq_ids):
            return "no free seq id"
        return f"needs {cost.pages} pages, {self.available() - cost.parked_hits} available"

    # ---------------------------------------------------------------- pages

    def take(self, n: int) -> list[int]:
        """n pages with refcount 1, evicting LRU tree leaves when the free list is short."""
        short = n - len(self.pool.free)
        if short > 0:
            evicted = self.tree.evict(short)
            for page, _ in evicted:
                self.pool.put(page)
            self.counters.evictions += len(evicted)
            self.events.evicted([h for _, h in evicted])
        return self.pool.take(n)

    def grow(self, seq: Sequence, num_tokens: int) -> list[int]:
        """Pages appended to `seq` so it has slots for positions 0 .. num_tokens-1."""
        n = -(-num_tokens // self.page_size) - len(seq.pages)
        new = self.take(n) if n > 0 else []
        seq.pages.extend(new)
        return new

    def hold(self, page: int) -> None:
        """One more reference to an existing page (a prefix hit, a fork)."""
        ref = self.pool.ref
        if ref[page] == 0:
            self.tree.unpark(page)
        ref[page] += 1

    def drop(self, page: int) -> bool:
        """One reference fewer; True when the page went back to the free list."""
        ref = self.pool.ref
        ref[page] -= 1
        if ref[page]:
            return False
        if self.tree.is_node(page):
            self.tree.park(page)
            return False
        self.pool.put(page)
        return True

    # ------------------------------------------------------------ sequences

    def add(self, seq: Sequence) -> None:
        """A new live sequence, last in the running order."""
        self.seqs[seq.seq_id] = seq
        self.by_request[seq.request_id] = seq.seq_id
        self.running[seq.seq_id] = None

    def forget(self, seq: Sequence, defer_id: bool = False) -> None:
        """The sequence is gone; its seq id is free now, or with `defer_id` after the step."""
        if defer_id:
            self.pending_seq_ids.append(seq.seq_id)
        else:
            self.seq_ids.release(seq.seq_id)
        del self.seqs[seq.seq_id]
        del self.by_request[seq.request_id]
        self.running.pop(seq.seq_id, None)
        self.swapped.pop(seq.seq_id, None)

    def settle(self) -> None:
        """End of a call: deferred CPU pages and seq ids become free."""
        self.cpu.settle()
        for seq_id in self.pending_seq_ids:
            self.seq_ids.release(seq_id)
        self.pending_seq_ids.clear()

    def reset(self, epoch: int | None = None) -> None:
        """Drops every sequence and cached page (the device bytes are gone); a new epoch, when
        given, is the one the reset event carries."""
        if epoch is not None:
            self.epoch = self.events.epoch = epoch
        self.pool.reset()
        self.cpu.reset()
        self.tree.reset()
        self.seq_ids.reset()
        self.seqs.clear()
        self.by_request.clear()
        self.running.clear()
        self.swapped.clear()
        self.pending_seq_ids.clear()
        self.events.reset()

    def stats(self) -> Stats:
        free = len(self.pool.free)
        cached = self.tree.num_evictable   # a page a slide left blocked is not: it counts as used
        c = self.counters
        return Stats(
            total_pages=self.pool.num_pages, free_pages=free, cached_pages=cached,
            used_pages=self.pool.num_pages - free - cached, num_sequences=len(self.seqs),
            free_seq_ids=len(self.seq_ids), cpu_total_pages=self.cpu.num_pages,
            cpu_free_pages=len(self.cpu.free) + len(self.cpu.pending),
            prefix_query_tokens=c.prefix_query_tokens, prefix_hit_tokens=c.prefix_hit_tokens,
            evictions=c.evictions, preemptions_recompute=c.preemptions_recompute,
            preemptions_swap=c.preemptions_swap, page_size=self.page_size,
            max_seqs=self.seq_ids.max_seqs, num_swapped=len(self.swapped),
            epoch=self.epoch, tree_pages=len(self.tree), last_event=self.events.last)
