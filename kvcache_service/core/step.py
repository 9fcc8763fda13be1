"""Step: the engine's one round trip per iteration. The manager's policy lives here.

Order inside a step: validate everything (a bad request changes nothing) →
releases → truncations → commits → slides (the first slide of a sequence that began with a
prefix hit before its commit) → needs, highest priority first.

Policy:
- A Grow that does not fit preempts running sequences from the tail of the
  running order (the most recently admitted, resumed or forked first) until it
  fits. When the tail is the growing sequence itself, and swapped sequences keep
  device pages enough to make it fit, the fewest of them that do, earliest swapped
  first, go back to be recomputed instead: the growing sequence does not lose its
  work to sequences that are not running; else it is the victim.
- Admissions and resumes never preempt. Once one is refused, every later
  admission and resume in the step is refused too, so nobody overtakes it
  (FCFS; swapped sequences resume before new ones when the engine lists them first).
  A step in which a Grow preempted admits and resumes nothing either: the room it
  freed would go to a younger request, which would overtake the victim (waiting at
  the head again) and later be preempted before it, or make it the victim again.
- Forks never preempt.
- A victim is preempted by SWAP when the request asks for it and the CPU pool has
  room, else by RECOMPUTE. A victim whose pages were handed out or written by a copy
  in this step has nothing worth saving and is preempted by RECOMPUTE.

The mechanisms it drives (state.py and the operation modules beside it) change state only
as told; nothing below this file calls back into it.
"""

from __future__ import annotations

from kvserve.kvcache_service.contract.types import (
    Admit,
    Fork,
    Grow,
    Need,
    NeedResult,
    Preemption,
    PreemptionMode,
    Resume,
    StepPlan,
    StepRequest,
)
from kvserve.kvcache_service.core import admission, allocation, commit, release, swap
from kvserve.kvcache_service.core.state import Cost, ManagerState
from kvserve.kvcache_service.core.validation import validate_step

_QUEUE_CLOSED = "an earlier admission or resume was refused in this step"
_PREEMPTED = "a running sequence was preempted in this step: the room goes to it first"


def run_step(state: ManagerState, req: StepRequest) -> StepPlan:
    validate_step(state, req)
    return _Step(state, req).run()


class _Step:
    """One step's serving loop and the bookkeeping its policy needs."""

    def __init__(self, state: ManagerState, req: StepRequest) -> None:
        self.state = state
        self.req = req
        self.plan = StepPlan()
        self.preempted: set[int] = set()
        self.fresh: set[int] = set()                  # got pages or copies this step: RECOMPUTE if preempted
        self.copies_of: dict[int, list[tuple[int, int]]] = {}   # seq id -> its copy-on-write copies in the plan
        self.resumed: dict[int, tuple[list, list[int]]] = {}  # seq id -> (swap-in copies, pages to re-publish)
        self.granted: dict[int, int] = {}             # seq id -> index of its granted result
        self.queue_closed: str | None = None          # why admissions and resumes are refused now
        self.swapped_recomputed = 0                   # swapped sent back to be recomputed: first in plan.preempted

    def run(self) -> StepPlan:
        state, req, plan = self.state, self.req, self.plan
        for seq_id in req.releases:
            release.release(state, state.seqs[seq_id])
        for t in req.truncations:
            _, copies = release.truncate(state, state.seqs[t.seq_id], t.num_tokens)
            if copies:
                self._copy(t.seq_id, copies)
        # A sequence that began with a prefix hit slides before it commits in the step of its
        # first slide, and so stores none of that commit: stored, the chunk after the hit made the
        # cached chain a chunk longer at each reuse, every page blocked by the sequence's own,
        # until a request that fits the model length was refused mid-prefill. (One that began
        # without a hit stores its first chunk even when that chunk crosses the window: its chain
        # is what later requests hit.)
        early = set()
        for s in req.slides:
            seq = state.seqs[s.seq_id]
            if seq.cached_tokens and not seq.slid:
                release.slide(state, seq, s.first_page, s.end_page)
                early.add(s.seq_id)
        for c in req.commits:
            commit.commit(state, c)
        for s in req.slides:
            if s.seq_id not in early:
                release.slide(state, state.seqs[s.seq_id], s.first_page, s.end_page)
        for need in req.needs:
            result = self._grow(need) if type(need) is Grow else self._serve(need)
            if result.granted:
                self.granted[result.seq_id] = len(plan.results)
            plan.results.append(result)
        for seq_id, (copies, renodes) in self.resumed.items():
            plan.swap_in.extend(copies)
            commit.publish(state, state.seqs[seq_id], renodes)  # only now: their copies will surely run
        state.settle()
        plan.available_pages = state.available()
        return plan

    def _serve(self, need: Need) -> NeedResult:
        if isinstance(need, Admit):
            return self._admit(need)
        if isinstance(need, Resume):
            return self._resume(need)
        assert isinstance(need, Fork)
        return self._fork(need)

    def _grow(self, need: Grow) -> NeedResult:
        state = self.state
        if need.seq_id in self.preempted:
            return NeedResult(False, need.seq_id, reason="preempted earlier in this step")
        seq = state.seqs[need.seq_id]
        n = -(-need.num_tokens // state.page_size) - len(seq.pages)
        if n <= 0:
            return NeedResult(True, need.seq_id, [])
        if n <= state.available():   # fits without preempting anybody: the common case, kept short
            return NeedResult(True, need.seq_id, state.grow(seq, need.num_tokens))
        room = self._room_ever(seq, need.seq_id, n)
        if n > room:   # it could never fit: nobody is preempted for it, itself included
            return NeedResult(False, need.seq_id, reason=f"needs {n} more pages; at most {room} could be had "
                              "even with every other sequence gone")
        cost = Cost(n)
        while not state.fits(cost):
            victim = next(reversed(state.running))
            if victim == need.seq_id and self._recompute_swapped(cost):
                break
            self._preempt(victim)
            self.queue_closed = self.queue_closed or _PREEMPTED
            if victim == need.seq_id:
                return NeedResult(False, need.seq_id, reason="preempted: not enough pages even after "
                                  "preempting every lower-priority sequence")
        return allocation.grow(state, seq, need.num_tokens)

    def _recompute_swapped(self, cost: Cost) -> bool:
        """Sends swapped sequences back to be recomputed so that `cost` fits; False, with nothing
        changed, when all of them together would not make it fit. Which: the earliest swapped
        that make it fit, less any the rest of them make it fit without (latest first), so that
        none loses its work for nothing (one whose pages another swapped one shares, or a running
        one: a family's prompt). They go ahead of this step's other victims in the plan: the
        engine reads it lowest priority first, and resumes the latest swapped first. (A slid
        sequence keeps its tree pages on the device when swapped: _leaving in swap.py. Left
        there, they made the only running sequence preempt itself and lose its work to a swapped
        one, which lost its own the same way a few steps later, round and round.)"""
        state = self.state
        chosen = self._fewest_swapped_for(cost)
        if not chosen:
            return False
        plan = self.plan
        for seq in chosen:
            recompute = Preemption(seq.seq_id, seq.request_id, PreemptionMode.RECOMPUTE)
            if seq.seq_id in self.preempted:   # swapped in this step: its swap is undone, as a recompute
                moved = {cpu_page for _, cpu_page, _ in seq.swapped}
                plan.swap_out[:] = [pair for pair in plan.swap_out if pair[1] not in moved]
                plan.preempted[:] = [recompute if p.seq_id == seq.seq_id else p for p in plan.preempted]
                state.counters.preemptions_swap -= 1
            else:
                # after the swapped sent back before it in this step, before the running victims
                plan.preempted.insert(self.swapped_recomputed, recompute)
                self.swapped_recomputed += 1
                self.preempted.add(seq.seq_id)
            release.release(state, seq, defer_id=True)
            state.counters.preemptions_recompute += 1
            self.queue_closed = self.queue_closed or _PREEMPTED
        return state.fits(cost)   # (the forecast counts exactly what releasing them frees)

    def _fewest_swapped_for(self, cost: Cost) -> list:
        """The swapped sequences _recompute_swapped sends back, earliest swapped first; [] when
        none or all of them would not make `cost` fit. Worked out with forecasts of their drops
        (release.DropForecast), before any is made."""
        state = self.state

        def gained(forecast, seq) -> int:
            return sum(forecast.drop(page) for page in reversed(seq.pages) if page >= 0)

        def fits_with(gain: int) -> bool:
            return state.fits(Cost(cost.pages - gain, cost.parked_hits))

        chosen, forecast, gain = [], release.DropForecast(state), 0
        for seq_id in state.swapped:
            seq = state.seqs[seq_id]
            if any(page >= 0 for page in seq.pages):
                chosen.append(seq)
                gain += gained(forecast, seq)
                if fits_with(gain):
                    break
        else:
            return []
        # the last one chosen is needed (those before it did not make it fit); any other may not be
        for seq in reversed(chosen[:-1]):
            rest = [other for other in chosen if other is not seq]
            forecast = release.DropForecast(state)
            if fits_with(sum(gained(forecast, other) for other in rest)):
                chosen = rest
        return chosen

    def _room_ever(self, seq, seq_id: int, wanted: int) -> int:
        """Pages a Grow of `seq` could have were every other sequence gone: the pool less its own
        pages, and less the pages a slide of its own left blocked (they come back only when it
        lets go of the pages below them). Worked out page by page (every other sequence's table)
        only when blocked pages could make the difference to the `wanted` pages: there are none
        without sliding windows, and a Grow past the pool less its own pages is refused without.
        (Pages swapped sequences keep on the device count as room: a Grow short of them sends
        those sequences back to be recomputed: _recompute_swapped.)"""
        state = self.state
        bound = state.pool.num_pages - sum(1 for page in seq.pages if page >= 0)
        blocked = state.tree.num_parked - state.tree.num_evictable
        if not blocked or wanted > bound:
            return bound
        forecast = release.DropForecast(state)
        return state.available() + sum(forecast.drop(page) for other_id, other in state.seqs.items()
                                       if other_id != seq_id for page in reversed(other.pages) if page >= 0)

    def _admit(self, need: Admit) -> NeedResult:
        state = self.state
        if self.queue_closed:
            return NeedResult(False, reason=self.queue_closed)
        found = admission.match(state, need)
        if not state.fits(found.cost):
            self.queue_closed = _QUEUE_CLOSED
            return NeedResult(False, reason=state.shortage(found.cost))
        result = admission.admit(state, need, found)
        self.fresh.add(result.seq_id)
        return result

    def _resume(self, need: Resume) -> NeedResult:
        state = self.state
        if self.queue_closed:
            return NeedResult(False, need.seq_id, reason=self.queue_closed)
        seq = state.seqs[need.seq_id]
        cost = swap.resume_cost(state, seq, need.num_tokens)
        if not state.fits(cost):
            self.queue_closed = _QUEUE_CLOSED
            return NeedResult(False, need.seq_id, reason=state.shortage(cost))
        result, copies, renodes = swap.swap_in(state, seq, need.num_tokens, publish_now=False)
        self.resumed[need.seq_id] = (copies, renodes)
        self.fresh.add(need.seq_id)
        return result

    def _fork(self, need: Fork) -> NeedResult:
        state = self.state
        parent = need.parent_seq_id
        if parent in self.preempted:
            return NeedResult(False, reason=f"parent seq id {parent} was preempted in this step")
        # (A parent resumed in this step cannot get here: validation wants it running already.)
        cost = allocation.cost_of(state, need)
        if not state.fits(cost):
            return NeedResult(False, reason=state.shortage(cost))
        result, copies = allocation.fork(state, state.seqs[parent], need.request_id, need.num_tokens)
        self._copy(result.seq_id, copies)
        self.fresh.add(result.seq_id)
        return result

    def _copy(self, seq_id: int, copies: list[tuple[int, int]]) -> None:
        self.plan.copies.extend(copies)
        self.copies_of.setdefault(seq_id, []).extend(copies)
        self.fresh.add(seq_id)

    def _preempt(self, seq_id: int) -> None:
        """Preempts a running sequence: SWAP when asked and the CPU pool has room, else RECOMPUTE
        (its seq id is freed at the end of the step)."""
        state, plan = self.state, self.plan
        seq = state.seqs[seq_id]
        mode = PreemptionMode.RECOMPUTE if seq_id in self.fresh else self.req.preemption_mode
        self.resumed.pop(seq_id, None)  # its swap-in copies would land in freed pages
        stale = set(self.copies_of.pop(seq_id, ()))
        if stale:   # so would its copy-on-write copies, on pages a later need of the step may be given
            plan.copies[:] = [pair for pair in plan.copies if pair not in stale]
        # A swap that moves nothing (every page shared, or no CPU pool) frees no device page: the
        # pages it shares stay held by it. Recomputing lets go of them.
        if mode is PreemptionMode.SWAP and 0 < swap.swap_out_cost(state, seq) <= len(state.cpu.free):
            plan.swap_out.extend(swap.swap_out(state, seq))
            state.counters.preemptions_swap += 1
        else:
            mode = PreemptionMode.RECOMPUTE
            release.release(state, seq, defer_id=True)
            state.counters.preemptions_recompute += 1
        plan.preempted.append(Preemption(seq_id, seq.request_id, mode))
        self.preempted.add(seq_id)
        index = self.granted.pop(seq_id, None)
        if index is not None:
            plan.results[index] = NeedResult(False, seq_id, reason="preempted by a higher-priority need")
