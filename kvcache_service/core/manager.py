"""KVCacheManager: the state and the mechanisms (allocate, commit, release, fork,
truncate, swap) behind every RPC. Step's priority and preemption policy lives
in step.py; this file only changes state as it is told.

Rules kept here (ARCHITECTURE.md):
- can_allocate is a pure check, and allocate never re-checks: both count
  parked (cached, unreferenced) pages as available.
- Admission never hits the page holding the last prompt token.
- A page enters the tree only when it is full and committed as computed.
- Release frees private pages and parks tree pages, tail first, so eviction
  takes leaves before their parents.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass

from kvserve.kvcache_service.core.errors import (
    AlreadyExists,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
)
from kvserve.kvcache_service.core.events import EventLog
from kvserve.kvcache_service.core.hashing import ROOT_HASH, hash_pages, token_bytes, checked_token_bytes, iter_page_hashes
from kvserve.kvcache_service.core.page_pool import CpuPool, PagePool
from kvserve.kvcache_service.core.prefix_tree import PrefixTree
from kvserve.kvcache_service.core.seq_ids import SeqIdPool
from kvserve.kvcache_service.core.sequence import SWAPPED_OUT, Sequence
from kvserve.kvcache_service.core.types import (
    Admit,
    Check,
    Commit,
    Fork,
    Grow,
    Need,
    NeedResult,
    PreemptionMode,
    Resume,
    SeqState,
    SequenceInfo,
    Stats,
    StepPlan,
    StepRequest,
)

_INT32_MAX = 2**31 - 1


def _out_of_range(token_ids: Seq[int]) -> int | None:
    """The first token id outside [0, 2^31), or None."""
    if not token_ids or checked_token_bytes(token_ids) is not None:  # one C pass: the common case
        return None
    return next((t for t in token_ids if not (isinstance(t, int) and 0 <= t <= _INT32_MAX)), token_ids[0])


@dataclass(frozen=True, slots=True)
class ManagerConfig:
    """Sizes of the pools. Defaults fit a demo on one small model."""
    num_pages: int = 4096      # device pages; must equal the model service's
    page_size: int = 16        # tokens per page; must equal the model service's
    max_seqs: int = 256        # live sequences at once (the seq-id pool)
    cpu_pages: int = 0         # CPU swap pages; 0 disables SWAP preemption
    event_capacity: int = 65536  # events kept for slow WatchEvents subscribers

    def __post_init__(self) -> None:
        for name in ("num_pages", "page_size", "max_seqs", "event_capacity"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if not isinstance(self.cpu_pages, int) or self.cpu_pages < 0:
            raise ValueError(f"cpu_pages must be a non-negative integer, got {self.cpu_pages!r}")


@dataclass(slots=True)
class Cost:
    """What serving one need takes. `parked_hits` are cached pages the need
    will reference: they stop being evictable, so they do not count as available."""
    pages: int
    parked_hits: int = 0
    seq_ids: int = 0


class KVCacheManager:
    def __init__(self, config: ManagerConfig | None = None) -> None:
        self.config = config = config or ManagerConfig()
        self.page_size = config.page_size
        self.pool = PagePool(config.num_pages)
        self.cpu = CpuPool(config.cpu_pages)
        self.tree = PrefixTree(config.num_pages)
        self.seq_ids = SeqIdPool(config.max_seqs)
        self.events = EventLog(config.event_capacity)
        self.seqs: dict[int, Sequence] = {}
        self.by_request: dict[str, int] = {}
        self.running: dict[int, None] = {}  # running order: admitted / resumed / forked, oldest first
        self.epoch = 0
        self._pending_seq_ids: list[int] = []  # freed by preemption; reusable after the step
        # Counters run from start-up, through resets (like any monitoring counter).
        self.prefix_query_tokens = 0
        self.prefix_hit_tokens = 0
        self.evictions = 0
        self.preemptions_recompute = 0
        self.preemptions_swap = 0

    # ---------------------------------------------------------------- lookup

    def available(self) -> int:
        """Pages an allocation can have: free plus parked (evictable)."""
        return len(self.pool.free) + self.tree.num_evictable

    def resolve(self, seq_id: int | None = None, request_id: str | None = None) -> Sequence:
        if request_id is not None:
            sid = self.by_request.get(request_id)
            if sid is None:
                raise NotFound(f"unknown request id {request_id!r}")
            return self.seqs[sid]
        seq = self.seqs.get(seq_id)  # type: ignore[arg-type]
        if seq is None:
            raise NotFound(f"unknown seq id {seq_id}")
        return seq

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

    # ------------------------------------------------------- page mechanics

    def _take(self, n: int) -> list[int]:
        """n pages with refcount 1, evicting LRU tree leaves when the free list is short."""
        short = n - len(self.pool.free)
        if short > 0:
            evicted = self.tree.evict(short)
            for page, _ in evicted:
                self.pool.put(page)
            self.evictions += len(evicted)
            self.events.evicted([h for _, h in evicted])
        return self.pool.take(n)

    def _hold(self, page: int) -> None:
        """One more reference to an existing page (a prefix hit, a fork)."""
        ref = self.pool.ref
        if ref[page] == 0:
            self.tree.unpark(page)
        ref[page] += 1

    def _drop(self, page: int) -> bool:
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

    def _fits(self, cost: Cost) -> bool:
        return (cost.pages <= self.available() - cost.parked_hits
                and cost.seq_ids <= len(self.seq_ids))

    # ----------------------------------------------------------- validation

    def check_admit(self, need: Admit, pending: set[str] | None = None) -> None:
        if not need.request_id:
            raise InvalidArgument("admit: request_id must not be empty")
        if need.request_id in self.by_request or (pending and need.request_id in pending):
            raise AlreadyExists(f"request id {need.request_id!r} is already live")
        if not need.token_ids:
            raise InvalidArgument(f"admit {need.request_id!r}: token_ids must not be empty")
        if need.max_tokens is not None and need.max_tokens <= 0:
            raise InvalidArgument(f"admit {need.request_id!r}: max_tokens must be positive, got {need.max_tokens}")
        bad = _out_of_range(need.token_ids)
        if bad is not None:
            raise InvalidArgument(f"admit {need.request_id!r}: token id {bad} is not in [0, 2^31)")

    def check_need(self, need: Need, pending: set[str] | None = None) -> None:
        """Raises for a malformed need or one naming a sequence in the wrong state."""
        if isinstance(need, Grow):
            self.running_seq(need.seq_id)
            if need.num_tokens <= 0:
                raise InvalidArgument(f"grow seq id {need.seq_id}: num_tokens must be positive, got {need.num_tokens}")
        elif isinstance(need, Admit):
            self.check_admit(need, pending)
        elif isinstance(need, Resume):
            self.swapped_seq(need.seq_id)
            if need.num_tokens < 0:
                raise InvalidArgument(f"resume seq id {need.seq_id}: num_tokens must not be negative")
        elif isinstance(need, Fork):
            self.running_seq(need.parent_seq_id)
            if not need.request_id:
                raise InvalidArgument("fork: the child's request_id must not be empty")
            if need.request_id in self.by_request or (pending and need.request_id in pending):
                raise AlreadyExists(f"request id {need.request_id!r} is already live")
        else:
            raise InvalidArgument(f"unknown need {need!r}")

    def check_commit(self, c: Commit, num_tokens: int | None = None) -> None:
        """num_tokens: the sequence's token count if a truncation precedes the commit."""
        seq = self.seqs.get(c.seq_id)
        if seq is None or seq.state is not SeqState.RUNNING:
            seq = self.running_seq(c.seq_id)  # raises the right error
        if num_tokens is None:  # the common case, in one expression; any failure is reported below
            n, ids = c.num_computed, c.token_ids
            if (seq.num_computed <= n <= len(seq.tokens) + len(ids) and n <= len(seq.pages) * self.page_size
                    and _out_of_range(ids) is None):
                return
        known = (len(seq.tokens) if num_tokens is None else num_tokens) + len(c.token_ids)
        computed = seq.num_computed if num_tokens is None else min(seq.num_computed, num_tokens)
        pages = len(seq.pages) if num_tokens is None else min(len(seq.pages), -(-num_tokens // self.page_size))
        slots = pages * self.page_size
        if c.num_computed < computed:
            raise InvalidArgument(
                f"commit seq id {c.seq_id}: num_computed {c.num_computed} is below the {computed} "
                "already computed (use Truncate to roll back)")
        if c.num_computed > known:
            raise InvalidArgument(
                f"commit seq id {c.seq_id}: num_computed {c.num_computed} exceeds the {known} known tokens")
        if c.num_computed > slots:
            raise InvalidArgument(
                f"commit seq id {c.seq_id}: num_computed {c.num_computed} exceeds the {slots} slots held")
        bad = _out_of_range(c.token_ids)
        if bad is not None:
            raise InvalidArgument(f"commit seq id {c.seq_id}: token id {bad} is not in [0, 2^31)")

    def check_truncate(self, seq_id: int, num_tokens: int) -> Sequence:
        seq = self.running_seq(seq_id)
        if num_tokens <= 0:
            raise InvalidArgument(f"truncate seq id {seq_id}: num_tokens must be positive, got {num_tokens}")
        if num_tokens >= len(seq.tokens):
            raise InvalidArgument(
                f"truncate seq id {seq_id}: cannot drop {num_tokens} of its {len(seq.tokens)} tokens "
                "(at least one must stay; release it instead)")
        return seq

    # ---------------------------------------------------------------- costs

    def cost(self, need: Need) -> Cost:
        """Pages and seq ids serving `need` takes now (the need is valid)."""
        ps = self.page_size
        if isinstance(need, Grow):
            seq = self.seqs[need.seq_id]
            return Cost(max(0, -(-need.num_tokens // ps) - len(seq.pages)))
        if isinstance(need, Admit):
            return self.plan_admit(need).cost
        if isinstance(need, Resume):
            seq = self.seqs[need.seq_id]
            copies, _, parked = self._resume_split(seq)
            grow = max(0, -(-need.num_tokens // ps) - len(seq.pages))
            return Cost(len(copies) + grow, parked)
        parent = self.seqs[need.parent_seq_id]
        return Cost(1 if parent.num_computed % ps else 0, 0, 1)

    # ------------------------------------------------------------ admission

    def plan_admit(self, need: Admit) -> AdmitPlan:
        """Matches the prompt against the tree (read-only)."""
        tokens, ps = need.token_ids, self.page_size
        limit = (len(tokens) - 1) // ps  # never the page holding the last token
        tree, ref = self.tree, self.pool.ref
        hits = tree.match_bytes(token_bytes(tokens[: limit * ps]), ps * 4, need.extra_key) if limit > 0 else []
        hash_of = tree.hash_of
        hashes = [hash_of[page] for page in hits]  # known: the hits are nodes
        parked = 0
        for page in hits:
            if not ref[page]:
                parked += 1
        cached = len(hits) * ps
        todo = len(tokens) - cached
        if need.max_tokens is not None:
            todo = min(todo, need.max_tokens)
        return AdmitPlan(hashes, hits, cached, todo, Cost(-(-(cached + todo) // ps) - len(hits), parked, 1))

    def admit(self, need: Admit, plan: AdmitPlan | None = None) -> NeedResult:
        """Admits a checked need whose plan fits."""
        plan = plan or self.plan_admit(need)
        seq_id = self.seq_ids.acquire()
        seq = Sequence(seq_id, need.request_id, need.extra_key, list(need.token_ids))
        ref, unpark = self.pool.ref, self.tree.unpark
        for page in plan.hits:  # _hold, inlined
            if not ref[page]:
                unpark(page)
            ref[page] += 1
        seq.pages = plan.hits + self._take(plan.cost.pages)
        seq.hashes = plan.hashes
        seq.num_computed = seq.cached_tokens = plan.cached
        seq.num_published = len(plan.hits)
        self.seqs[seq_id] = seq
        self.by_request[need.request_id] = seq_id
        self.running[seq_id] = None
        self.prefix_query_tokens += len(seq.tokens)
        self.prefix_hit_tokens += plan.cached
        return NeedResult(True, seq_id, list(seq.pages), True, plan.cached, plan.todo)

    # ----------------------------------------------------------------- grow

    def grow(self, seq: Sequence, num_tokens: int) -> NeedResult:
        n = -(-num_tokens // self.page_size) - len(seq.pages)
        new = self._take(n) if n > 0 else []
        seq.pages.extend(new)
        return NeedResult(True, seq.seq_id, new)

    # --------------------------------------------------------------- commit

    def commit(self, c: Commit) -> int:
        """Records computed tokens; full computed pages enter the tree. Returns pages stored."""
        seq = self.seqs[c.seq_id]
        tokens = seq.tokens
        if c.token_ids:
            tokens.extend(c.token_ids)
        seq.num_computed = c.num_computed
        ps = self.page_size
        full = min(c.num_computed, len(tokens)) // ps
        first = seq.num_published
        if full <= first:
            return 0
        hashes = seq.hashes
        data = token_bytes(tokens[first * ps : full * ps])  # pages first .. full-1, packed once
        if len(hashes) < full:
            start = len(hashes)  # >= first: published pages always have their hashes
            hashes += hash_pages(data, ps, seq.extra_key, hashes[start - 1] if start else ROOT_HASH, start - first)
        stored = 0
        chain: list[int] = []
        chain_parent = ROOT_HASH
        tree, pages, get, key, width = self.tree, seq.pages, self.tree.page_of.get, seq.extra_key, ps * 4
        for i in range(first, full if seq.diverged_at is None else first):
            h = hashes[i]
            existing = get(h)
            if existing is None:
                parent = hashes[i - 1] if i else ROOT_HASH
                if not chain:
                    chain_parent = parent
                off = (i - first) * width
                tree.insert(h, parent, pages[i], data[off : off + width], key)
                chain.append(h)
                continue
            if chain:
                self.events.stored(chain_parent, chain)
                stored += len(chain)
                chain = []
            if existing != pages[i]:
                seq.diverged_at = i  # another sequence stored this page first; ours stays private
                break
        if chain:
            self.events.stored(chain_parent, chain)
            stored += len(chain)
        seq.num_published = full
        return stored

    # -------------------------------------------------------------- release

    def release(self, seq: Sequence, defer_id: bool = False) -> tuple[int, int]:
        """Ends a sequence now; its CPU pages (and, with defer_id, its seq id) are
        freed at the end of the call. Returns (pages freed, pages left cached)."""
        freed = cached = 0
        ref, free, hash_of, park = self.pool.ref, self.pool.free, self.tree.hash_of, self.tree.park
        for page in reversed(seq.pages):  # tail first: leaves park before parents (_drop, inlined)
            if page == SWAPPED_OUT:
                continue
            left = ref[page] - 1
            ref[page] = left
            if left:
                continue
            if hash_of[page] is not None:
                park(page)
                cached += 1
            else:
                free.append(page)
                freed += 1
        if seq.swapped:
            self.cpu.put_later([cpu_page for _, cpu_page, _ in seq.swapped])
        if defer_id:
            self._pending_seq_ids.append(seq.seq_id)
        else:
            self.seq_ids.release(seq.seq_id)
        del self.seqs[seq.seq_id]
        del self.by_request[seq.request_id]
        self.running.pop(seq.seq_id, None)
        return freed, cached

    # ----------------------------------------------------------------- fork

    def fork(self, parent: Sequence, request_id: str) -> tuple[NeedResult, list[tuple[int, int]]]:
        """Child shares the parent's full computed pages; the partial one is copied."""
        ps = self.page_size
        full, partial = divmod(parent.num_computed, ps)
        seq_id = self.seq_ids.acquire()
        child = Sequence(seq_id, request_id, parent.extra_key, list(parent.tokens))
        child.pages = parent.pages[:full]
        for page in child.pages:
            self._hold(page)
        copies = []
        if partial:
            (page,) = self._take(1)
            copies.append((parent.pages[full], page))
            child.pages.append(page)
        child.num_computed = parent.num_computed
        child.hashes = parent.hashes[:full]
        child.num_published = min(parent.num_published, full)
        if parent.diverged_at is not None and parent.diverged_at < full:
            child.diverged_at = parent.diverged_at
        child.cached_tokens = parent.cached_tokens
        self.seqs[seq_id] = child
        self.by_request[request_id] = seq_id
        self.running[seq_id] = None
        return NeedResult(True, seq_id, list(child.pages), True), copies

    # ------------------------------------------------------------- truncate

    def truncate_cost(self, seq: Sequence, num_tokens: int) -> int:
        """1 when the new last page is partial and shared (it must be copied), else 0."""
        new_len = len(seq.tokens) - num_tokens
        keep = -(-new_len // self.page_size)
        if new_len % self.page_size == 0 or keep > len(seq.pages):
            return 0
        last = seq.pages[keep - 1]
        return 1 if (self.tree.is_node(last) or self.pool.ref[last] > 1) else 0

    def truncate_gain(self, seq: Sequence, num_tokens: int) -> int:
        """Pages a truncation makes available before it takes its copy page: the
        dropped pages nobody else references (each is freed or parked)."""
        keep = -(-(len(seq.tokens) - num_tokens) // self.page_size)
        ref = self.pool.ref
        return sum(1 for page in seq.pages[keep:] if ref[page] == 1)

    def truncate(self, seq: Sequence, num_tokens: int) -> tuple[int, list[tuple[int, int]]]:
        """Drops the last num_tokens tokens and exactly the pages past the new end.
        Returns (pages freed, copies). The caller checked truncate_cost fits."""
        ps = self.page_size
        copy_needed = self.truncate_cost(seq, num_tokens)
        new_len = len(seq.tokens) - num_tokens
        keep = -(-new_len // ps)
        freed = 0
        for page in reversed(seq.pages[keep:]):
            freed += self._drop(page)
        del seq.pages[keep:]
        copies = []
        if copy_needed:  # a shared or cached page becomes our last, partial one: write a copy
            last = seq.pages[keep - 1]
            (page,) = self._take(1)
            copies.append((last, page))
            seq.pages[keep - 1] = page
            freed += self._drop(last)
        full = new_len // ps
        del seq.tokens[new_len:]
        del seq.hashes[full:]
        seq.num_computed = min(seq.num_computed, new_len)
        seq.num_published = min(seq.num_published, full)
        if seq.diverged_at is not None and seq.diverged_at >= full:
            seq.diverged_at = None
        return freed, copies

    # ----------------------------------------------------------------- swap

    def swap_out_cost(self, seq: Sequence) -> int:
        """CPU pages a swap-out takes: the pages nobody else references."""
        ref = self.pool.ref
        return sum(1 for page in seq.pages if page != SWAPPED_OUT and ref[page] == 1)

    def swap_out(self, seq: Sequence) -> list[tuple[int, int]]:
        """Moves the private pages, tail first, to the CPU pool; pages another live
        sequence shares stay in place. The caller checked the CPU pool has room."""
        ref = self.pool.ref
        private = [i for i in range(len(seq.pages) - 1, -1, -1)
                   if seq.pages[i] != SWAPPED_OUT and ref[seq.pages[i]] == 1]
        copies = []
        for i, cpu_page in zip(private, self.cpu.take(len(private))):
            page = seq.pages[i]
            copies.append((page, cpu_page))
            seq.swapped.append((i, cpu_page, self.tree.is_node(page)))
            seq.pages[i] = SWAPPED_OUT
            self._drop(page)  # a tree page stays cached on the device: swap-in may find it there
        seq.state = SeqState.SWAPPED
        self.running.pop(seq.seq_id, None)
        return copies

    def _resume_split(self, seq: Sequence) -> tuple[list[tuple[int, int, bool]], list[tuple[int, int]], int]:
        """Swapped pages needing a copy back, pages found in the tree meanwhile
        (index, page), and how many of those are parked."""
        copies, hits = [], []
        page_of, ref = self.tree.page_of, self.pool.ref
        for entry in seq.swapped:
            index, _, was_node = entry
            page = page_of.get(seq.hashes[index]) if was_node else None
            if page is None:
                copies.append(entry)
            else:
                hits.append((index, page))
        parked = sum(1 for _, page in hits if ref[page] == 0)
        return copies, hits, parked

    def swap_in(self, seq: Sequence, num_tokens: int = 0,
                publish: bool = True) -> tuple[NeedResult, list[tuple[int, int]], list[int]]:
        """Brings a swapped sequence back; pages that entered the tree meanwhile are
        shared instead of copied. The caller checked the cost fits.

        Copied pages that were tree nodes go back into the tree — at once with
        `publish`, else the caller publishes the returned indices once it knows
        the copies will run (a Step may still preempt the sequence)."""
        to_copy, hits, _ = self._resume_split(seq)
        for index, page in hits:
            self._hold(page)
            seq.pages[index] = page
        new_pages = iter(self._take(len(to_copy)))
        copies, renodes = [], []
        for index, cpu_page, was_node in sorted(to_copy):
            page = next(new_pages)
            copies.append((cpu_page, page))
            seq.pages[index] = page
            if was_node:
                renodes.append(index)
        if publish:
            self.publish_pages(seq, renodes)
        self.cpu.put_later([cpu_page for _, cpu_page, _ in seq.swapped])
        seq.swapped = []
        seq.state = SeqState.RUNNING
        self.running[seq.seq_id] = None
        result = NeedResult(True, seq.seq_id, list(seq.pages), True)
        if num_tokens:
            result.page_ids.extend(self.grow(seq, num_tokens).page_ids)
        return result, copies, renodes

    def publish_pages(self, seq: Sequence, indices: list[int]) -> None:
        """Puts pages that were tree nodes before a swap-out back into the tree,
        head first so parents go in before children. A page whose hash another
        sequence stored meanwhile stays private, and so do the ones after it."""
        for index in indices:
            if seq.diverged_at is not None and index >= seq.diverged_at:
                return
            h, page = seq.hashes[index], seq.pages[index]
            existing = self.tree.get(h)
            if existing is None:
                parent = seq.parent_hash(index)
                ps = self.page_size
                self.tree.insert(h, parent, page, token_bytes(seq.tokens[index * ps : (index + 1) * ps]),
                                 seq.extra_key)
                self.events.stored(parent, [h])
            elif existing != page:
                seq.diverged_at = index
                return

    # ------------------------------------------------------------ preempting

    def preempt(self, seq: Sequence, mode: PreemptionMode, plan: StepPlan) -> PreemptionMode:
        """Preempts a running sequence; SWAP falls back to RECOMPUTE when the CPU
        pool lacks room. RECOMPUTE frees the seq id at the end of the step."""
        if mode is PreemptionMode.SWAP and self.swap_out_cost(seq) <= len(self.cpu.free):
            plan.swap_out.extend(self.swap_out(seq))
            self.preemptions_swap += 1
        else:
            mode = PreemptionMode.RECOMPUTE
            self.release(seq, defer_id=True)
            self.preemptions_recompute += 1
        return mode

    def settle(self) -> None:
        """End of a Step: deferred CPU pages and seq ids become free."""
        self.cpu.settle()
        for seq_id in self._pending_seq_ids:
            self.seq_ids.release(seq_id)
        self._pending_seq_ids.clear()

    # ------------------------------------------------------- fine-grained API

    def can_allocate(self, need: Need) -> Check:
        """Pure: True means allocate(need), called next, succeeds."""
        self.check_need(need)
        cost = self.cost(need)
        available = self.available() - cost.parked_hits
        if cost.seq_ids > len(self.seq_ids):
            return Check(False, cost.pages, max(available, 0), "no free seq id")
        if cost.pages > available:
            return Check(False, cost.pages, max(available, 0),
                         f"needs {cost.pages} pages, {available} available")
        return Check(True, cost.pages, available)

    def allocate(self, need: Need) -> tuple[NeedResult, list[tuple[int, int]], list[tuple[int, int]]]:
        """Serves one need without preempting. Returns (result, swap_in copies, copies)."""
        check = self.can_allocate(need)
        if not check.ok:
            raise ResourceExhausted(check.reason)
        swap_in: list[tuple[int, int]] = []
        copies: list[tuple[int, int]] = []
        if isinstance(need, Grow):
            result = self.grow(self.seqs[need.seq_id], need.num_tokens)
        elif isinstance(need, Admit):
            result = self.admit(need)
        elif isinstance(need, Resume):
            result, swap_in, _ = self.swap_in(self.seqs[need.seq_id], need.num_tokens)
        else:
            result, copies = self.fork(self.seqs[need.parent_seq_id], need.request_id)
        self.cpu.settle()
        return result, swap_in, copies

    def commit_one(self, c: Commit) -> int:
        self.check_commit(c)
        return self.commit(c)

    def release_one(self, seq: Sequence) -> tuple[int, int]:
        out = self.release(seq)
        self.cpu.settle()
        return out

    def match_prefix(self, token_ids: Seq[int], extra_key: str = "") -> tuple[int, list[int]]:
        """Read-only: (leading tokens cached, hashes of the matched pages)."""
        if not token_ids:
            raise InvalidArgument("match_prefix: token_ids must not be empty")
        hashes = []
        page_of = self.tree.page_of
        for h in iter_page_hashes(token_ids, self.page_size, extra_key):
            if h not in page_of:
                break
            hashes.append(h)
        return len(hashes) * self.page_size, hashes

    def fork_one(self, parent: Sequence, request_id: str) -> tuple[NeedResult, list[tuple[int, int]]]:
        need = Fork(parent.seq_id, request_id)
        result, _, copies = self.allocate(need)
        return result, copies

    def truncate_one(self, seq: Sequence, num_tokens: int) -> tuple[int, list[tuple[int, int]]]:
        self.check_truncate(seq.seq_id, num_tokens)
        if self.truncate_cost(seq, num_tokens) > self.available() + self.truncate_gain(seq, num_tokens):
            raise ResourceExhausted(f"truncate seq id {seq.seq_id}: no page left for the copy of its last page")
        return self.truncate(seq, num_tokens)

    def swap_out_one(self, seq: Sequence) -> list[tuple[int, int]]:
        if seq.state is not SeqState.RUNNING:
            raise FailedPrecondition(f"seq id {seq.seq_id} is already swapped out")
        need = self.swap_out_cost(seq)
        if need > len(self.cpu.free):
            raise ResourceExhausted(
                f"swap out seq id {seq.seq_id}: needs {need} CPU pages, {len(self.cpu.free)} free")
        copies = self.swap_out(seq)
        self.cpu.settle()
        return copies

    def swap_in_one(self, seq: Sequence) -> tuple[NeedResult, list[tuple[int, int]]]:
        result, swap_in, _ = self.allocate(Resume(seq.seq_id))
        return result, swap_in

    def step(self, request: StepRequest) -> StepPlan:
        from kvserve.kvcache_service.core.step import run_step  # policy lives apart from mechanism
        return run_step(self, request)

    # ------------------------------------------------------------ admin/info

    def register(self, epoch: int, page_size: int, num_pages: int) -> bool:
        """A model service (re)starts. Returns True when the epoch was new and the
        manager reset, so no stale page table outlives the device bytes."""
        if epoch <= 0:
            raise InvalidArgument(f"register: epoch must be positive, got {epoch}")
        if page_size != self.page_size:
            raise InvalidArgument(
                f"register: page_size {page_size} does not match the manager's {self.page_size}")
        if num_pages != self.pool.num_pages:
            raise InvalidArgument(
                f"register: num_pages {num_pages} does not match the manager's {self.pool.num_pages}")
        if epoch == self.epoch:
            return False
        self.reset()
        self.epoch = epoch
        return True

    def check_epoch(self, epoch: int) -> None:
        if epoch != self.epoch:
            raise FailedPrecondition(
                f"stale epoch {epoch}: the manager is at epoch {self.epoch}; register again")

    def reset(self) -> None:
        """Drops every sequence and cached page (the device bytes are gone)."""
        self.pool.reset()
        self.cpu.reset()
        self.tree.reset()
        self.seq_ids.reset()
        self.seqs.clear()
        self.by_request.clear()
        self.running.clear()
        self._pending_seq_ids.clear()
        self.events.reset()

    def sequence_info(self, seq: Sequence) -> SequenceInfo:
        return SequenceInfo(
            seq.seq_id, seq.request_id, seq.state, len(seq.tokens), seq.num_computed,
            [p for p in seq.pages if p != SWAPPED_OUT], [c for _, c, _ in sorted(seq.swapped)],
            seq.cached_tokens, seq.extra_key)

    def stats(self) -> Stats:
        free = len(self.pool.free)
        cached = self.tree.num_evictable
        return Stats(
            total_pages=self.pool.num_pages, free_pages=free, cached_pages=cached,
            used_pages=self.pool.num_pages - free - cached, num_sequences=len(self.seqs),
            free_seq_ids=len(self.seq_ids), cpu_total_pages=self.cpu.num_pages,
            cpu_free_pages=len(self.cpu.free) + len(self.cpu.pending),
            prefix_query_tokens=self.prefix_query_tokens, prefix_hit_tokens=self.prefix_hit_tokens,
            evictions=self.evictions, preemptions_recompute=self.preemptions_recompute,
            preemptions_swap=self.preemptions_swap, page_size=self.page_size,
            max_seqs=self.seq_ids.max_seqs, num_swapped=len(self.seqs) - len(self.running),
            epoch=self.epoch, tree_pages=len(self.tree), last_event=self.events.last)


@dataclass(slots=True)
class AdmitPlan:
    hashes: list[int]  # of the hits, then of the first miss if one was hashed
    hits: list[int]    # cached pages, in order
    cached: int        # tokens they hold
    todo: int          # tokens given slots beyond them
    cost: Cost
