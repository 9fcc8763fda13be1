"""KVCacheManager: the manager's API, one method per RPC.

    step()          the engine's one call per iteration: policy in step.py
    can_allocate()  a pure check; allocate() serves what it accepted, without checking again
    commit(), release(), truncate(), swap_out(), ...
                    the fine-grained calls: each runs the same checks (validation.py) and the
                    same mechanism (state.py, allocation.py, commit.py, release.py, swap.py)
                    that Step runs, for one operation

The rules these keep are listed, each with the test that pins it, in
kvcache_service/README.md and docs/architecture.md.
"""

from __future__ import annotations

import time
from collections.abc import Sequence as Seq

from kvserve.kvcache_service.contract.errors import FailedPrecondition, InvalidArgument, ResourceExhausted
from kvserve.kvcache_service.contract.hashing import iter_page_hashes
from kvserve.kvcache_service.contract.types import (
    Allocation,
    Check,
    Commit,
    Need,
    SeqState,
    SequenceInfo,
    Snapshot,
    Stats,
    StepPlan,
    StepRequest,
)
from kvserve.kvcache_service.core import allocation, commit, release, swap, validation
from kvserve.kvcache_service.core.config import ManagerConfig
from kvserve.kvcache_service.core.sequence import SWAPPED_OUT, table_view
from kvserve.kvcache_service.core.events import EventLog
from kvserve.kvcache_service.core.state import ManagerState
from kvserve.kvcache_service.core.step import run_step

MAX_EPOCH_LEAD_NS = 86_400 * 10**9   # how far ahead of this host's clock a registered epoch may be


class KVCacheManager:
    def __init__(self, config: ManagerConfig | None = None) -> None:
        self.config = config or ManagerConfig()
        self.state = ManagerState(self.config)

    @property
    def page_size(self) -> int:
        return self.config.page_size

    @property
    def epoch(self) -> int:
        return self.state.epoch

    @property
    def events(self) -> EventLog:
        return self.state.events

    # ------------------------------------------------------------ the engine

    def register(self, epoch: int, page_size: int, num_pages: int, cpu_pages: int | None = None) -> bool:
        """A model service (re)starts. Returns True when the epoch was new and the
        manager reset, so no stale page table outlives the device bytes. Epochs only move
        forward: the live epoch again changes nothing, an older one is refused (a stale
        instance must not wipe the live one's state)."""
        if epoch <= 0:
            raise InvalidArgument(f"register: epoch must be positive, got {epoch}")
        if epoch > time.time_ns() + MAX_EPOCH_LEAD_NS:
            # A model service's epoch is the time it registers (engine/manager_link.py); one far
            # ahead would outrank every restart after it, and the manager would serve no one again.
            raise InvalidArgument(f"register: epoch {epoch} is more than a day ahead of this host's clock; an "
                                  "epoch is the registering model service's time in nanoseconds")
        if epoch < self.state.epoch:
            raise FailedPrecondition(
                f"register: epoch {epoch} is older than the live epoch {self.state.epoch}: a newer model "
                "service has registered since, so this one is stale")
        if page_size != self.config.page_size:
            raise InvalidArgument(
                f"register: page_size {page_size} does not match the manager's {self.config.page_size}")
        if num_pages != self.config.num_pages:
            raise InvalidArgument(
                f"register: num_pages {num_pages} does not match the manager's {self.config.num_pages}")
        if cpu_pages is not None and cpu_pages < self.config.cpu_pages:
            raise InvalidArgument(
                f"register: the model service holds {cpu_pages} CPU swap pages, fewer than the manager's "
                f"{self.config.cpu_pages} (--cpu-pages): swaps would be planned into pages it does not have")
        if epoch == self.state.epoch:
            return False
        self.state.reset(epoch)
        return True

    def step(self, request: StepRequest) -> StepPlan:
        if request.epoch < self.state.epoch:
            raise FailedPrecondition(
                f"stale epoch {request.epoch}: the manager is at epoch {self.state.epoch}; register again")
        if request.epoch > self.state.epoch:
            raise FailedPrecondition(
                f"epoch {request.epoch} was never registered: the manager is at epoch {self.state.epoch}; "
                "register first")
        return run_step(self.state, request)

    def reset(self) -> None:
        """Drops every sequence and cached page (the device bytes are gone)."""
        self.state.reset()

    # ---------------------------------------------------- fine-grained calls

    def can_allocate(self, need: Need) -> Check:
        """Pure: True means allocate(need), called next, succeeds."""
        state = self.state
        validation.check_need(state, need)
        cost = allocation.cost_of(state, need)
        available = max(state.available() - cost.parked_hits, 0)
        if not state.fits(cost):
            return Check(False, cost.pages, available, state.shortage(cost))
        return Check(True, cost.pages, available)

    def allocate(self, need: Need) -> Allocation:
        """Serves a need can_allocate just accepted (it is not checked again), without preempting."""
        out = allocation.allocate(self.state, need)
        self.state.settle()
        return out

    def try_allocate(self, need: Need) -> Allocation:
        """The Allocate RPC: can_allocate, then allocate; ResourceExhausted with the reason if it
        does not fit."""
        check = self.can_allocate(need)
        if not check.ok:
            raise ResourceExhausted(check.reason)
        return self.allocate(need)

    def commit(self, c: Commit) -> int:
        """Tokens computed; returns the pages that entered the tree."""
        validation.check_commit(self.state, c)
        return commit.commit(self.state, c)

    def release(self, seq_id: int) -> tuple[int, int]:
        """Ends a sequence: (pages freed, pages left cached)."""
        out = release.release(self.state, self.state.resolve(seq_id))
        self.state.settle()
        return out

    def truncate(self, seq_id: int, num_tokens: int) -> tuple[list[int], int, list[tuple[int, int]]]:
        """Drops the last num_tokens tokens: (the page table after, pages freed, copies)."""
        state = self.state
        seq = validation.check_truncate(state, seq_id, num_tokens)
        validation.check_truncate_room(state, seq, num_tokens, state.available())
        freed, copies = release.truncate(state, seq, num_tokens)
        return table_view(seq.pages), freed, copies

    def swap_out(self, seq_id: int) -> list[tuple[int, int]]:
        """Moves a running sequence's private pages to the CPU pool: (device page, CPU page)."""
        state = self.state
        seq = state.resolve(seq_id)
        if seq.state is not SeqState.RUNNING:
            raise FailedPrecondition(f"seq id {seq_id} is already swapped out")
        need = swap.swap_out_cost(state, seq)
        if need > len(state.cpu.free):
            raise ResourceExhausted(f"swap out seq id {seq_id}: needs {need} CPU pages, {len(state.cpu.free)} free")
        if not self.config.cpu_pages:
            raise ResourceExhausted(f"swap out seq id {seq_id}: this manager has no CPU pages (--cpu-pages 0): "
                                    "swapping is off")
        if not need:   # its pages all shared: it would free nothing, yet be "swapped" (a Step recomputes it)
            raise ResourceExhausted(f"swap out seq id {seq_id}: every page it holds is shared, so a swap would "
                                    "free nothing")
        copies = swap.swap_out(state, seq)
        state.settle()
        return copies

    def match_prefix(self, token_ids: Seq[int], extra_key: str = "") -> tuple[int, list[int]]:
        """Read-only: (leading tokens cached, hashes of the matched pages)."""
        if not token_ids:
            raise InvalidArgument("match_prefix: token_ids must not be empty")
        validation.check_extra_key(extra_key, "match_prefix")
        bad = validation.out_of_range(token_ids)
        if bad is not None:   # as an admission would refuse it: no page could hold it
            raise InvalidArgument(f"match_prefix: token id {bad} is not in [0, 2^31)")
        hashes = []
        page_of = self.state.tree.page_of
        for h in iter_page_hashes(token_ids, self.config.page_size, extra_key):
            if h not in page_of:
                break
            hashes.append(h)
        return len(hashes) * self.config.page_size, hashes

    # ----------------------------------------------------------------- reads

    def seq_id_of(self, request_id: str) -> int:
        return self.state.seq_id_of(request_id)

    def sequence_info(self, seq_id: int) -> SequenceInfo:
        seq = self.state.resolve(seq_id)
        return SequenceInfo(
            seq.seq_id, seq.request_id, seq.state, len(seq.tokens), seq.num_computed,
            [p for p in table_view(seq.pages) if p != SWAPPED_OUT], [c for _, c, _ in sorted(seq.swapped)],
            seq.cached_tokens, seq.extra_key)

    def snapshot(self) -> Snapshot:
        """Every page in the tree, parents first, as of the last event."""
        state = self.state
        return Snapshot(state.events.last, tuple(state.tree.nodes_parent_first()), state.epoch)

    def stats(self) -> Stats:
        return self.state.stats()
