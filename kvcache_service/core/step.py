"""Step: the engine's one round trip per iteration, and the preemption policy.

Order inside a step: validate everything (a bad request changes nothing) →
releases → truncations → commits → needs, highest priority first.

Policy:
- A Grow that does not fit preempts running sequences from the tail of the
  running order (the most recently admitted, resumed or forked first) until it
  fits; when the tail is the growing sequence itself, it is the victim.
- Admissions and resumes never preempt. Once one is refused, every later
  admission and resume in the step is refused too, so nobody overtakes it
  (FCFS; swapped sequences resume before new ones when the engine lists them first).
- Forks never preempt.
- A victim preempted with SWAP keeps its seq id and resumes later; a victim
  whose pages were handed out or written by a copy in this step has nothing
  worth saving and is preempted by RECOMPUTE.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvserve.kvcache_service.core.errors import InvalidArgument, ResourceExhausted
from kvserve.kvcache_service.core.sequence import SWAPPED_OUT
from kvserve.kvcache_service.core.types import (
    Admit,
    Fork,
    Grow,
    NeedResult,
    Preemption,
    PreemptionMode,
    Resume,
    SeqState,
    StepPlan,
    StepRequest,
)

if TYPE_CHECKING:
    from kvserve.kvcache_service.core.manager import KVCacheManager


def run_step(m: KVCacheManager, req: StepRequest) -> StepPlan:
    m.check_epoch(req.epoch)
    _validate(m, req)
    return _Step(m, req).run()


def _validate(m: KVCacheManager, req: StepRequest) -> None:
    """Checks the whole request against the state it will meet, before any change."""
    released = set()
    gained = 0  # pages the releases make available (freed or parked) before the truncations run
    ref = m.pool.ref
    for seq_id in req.releases:
        seq = m.resolve(seq_id)
        if seq_id in released:
            raise InvalidArgument(f"step: seq id {seq_id} is released twice")
        released.add(seq_id)
        if req.truncations:  # only truncations need it: a walk over every page of the sequence
            gained += sum(1 for page in seq.pages if page != SWAPPED_OUT and ref[page] == 1)

    def live(seq_id: int, what: str) -> None:
        if seq_id in released:
            raise InvalidArgument(f"step: seq id {seq_id} is released and named by a {what} in the same step")

    truncated: dict[int, int] = {}
    available = m.available() + gained  # followed truncation by truncation, in the order they run
    for t in req.truncations:
        live(t.seq_id, "truncation")
        seq = m.check_truncate(t.seq_id, t.num_tokens)
        if t.seq_id in truncated:
            raise InvalidArgument(f"step: seq id {t.seq_id} is truncated twice")
        truncated[t.seq_id] = len(seq.tokens) - t.num_tokens
        available += m.truncate_gain(seq, t.num_tokens)
        cost = m.truncate_cost(seq, t.num_tokens)
        if cost > available:
            raise ResourceExhausted(f"step: truncating seq id {t.seq_id} needs {cost} page for the copy "
                                    f"of its last page, {available} available")
        available -= cost
    committed = set()
    for c in req.commits:
        live(c.seq_id, "commit")
        if c.seq_id in committed:
            raise InvalidArgument(f"step: seq id {c.seq_id} is committed twice")
        committed.add(c.seq_id)
        m.check_commit(c, truncated.get(c.seq_id))
    new_ids: set[str] = set()
    needing: set[int] = set()
    seqs = m.seqs
    for need in req.needs:
        if type(need) is Grow:  # the common need, checked inline; errors come from check_need
            seq_id = need.seq_id
            seq = seqs.get(seq_id)
            if seq is None or seq.state is not SeqState.RUNNING or need.num_tokens <= 0:
                m.check_need(need, new_ids)
            live(seq_id, "need")
            if seq_id in needing:
                raise InvalidArgument(f"step: seq id {seq_id} has two needs")
            needing.add(seq_id)
            continue
        m.check_need(need, new_ids)
        if isinstance(need, (Admit, Fork)):
            new_ids.add(need.request_id)
        if isinstance(need, Fork):
            live(need.parent_seq_id, "fork")
        if isinstance(need, (Grow, Resume)):
            live(need.seq_id, "need")
            if need.seq_id in needing:
                raise InvalidArgument(f"step: seq id {need.seq_id} has two needs")
            needing.add(need.seq_id)


class _Step:
    """One step's serving loop and the bookkeeping it needs."""

    def __init__(self, m: KVCacheManager, req: StepRequest) -> None:
        self.m = m
        self.req = req
        self.plan = StepPlan()
        self.preempted: set[int] = set()
        self.fresh: set[int] = set()                  # got pages or copies this step: RECOMPUTE if preempted
        self.resumed: dict[int, tuple[list, list[int]]] = {}  # seq id -> (swap-in copies, pages to re-publish)
        self.granted: dict[int, int] = {}             # seq id -> index of its granted result
        self.queue_closed = False                     # an admission or resume was refused

    def run(self) -> StepPlan:
        m, req, plan = self.m, self.req, self.plan
        for seq_id in req.releases:
            m.release(m.seqs[seq_id])
        for t in req.truncations:
            _, copies = m.truncate(m.seqs[t.seq_id], t.num_tokens)
            if copies:
                plan.copies.extend(copies)
                self.fresh.add(t.seq_id)
        for c in req.commits:
            m.commit(c)
        for need in req.needs:
            result = self._grow(need) if type(need) is Grow else self._serve(need)
            if result.granted:
                self.granted[result.seq_id] = len(plan.results)
            plan.results.append(result)
        for seq_id, (copies, renodes) in self.resumed.items():
            plan.swap_in.extend(copies)
            m.publish_pages(m.seqs[seq_id], renodes)  # only now: their copies will surely run
        m.settle()
        plan.available_pages = m.available()
        return plan

    def _serve(self, need) -> NeedResult:
        if isinstance(need, Grow):
            return self._grow(need)
        if isinstance(need, Admit):
            return self._admit(need)
        if isinstance(need, Resume):
            return self._resume(need)
        return self._fork(need)

    def _grow(self, need: Grow) -> NeedResult:
        m = self.m
        if need.seq_id in self.preempted:
            return NeedResult(False, need.seq_id, reason="preempted earlier in this step")
        seq = m.seqs[need.seq_id]
        n = -(-need.num_tokens // m.page_size) - len(seq.pages)
        if n <= 0:
            return NeedResult(True, need.seq_id, [])
        if n <= m.available():  # fits without preempting anybody: what m.grow below would do
            pages = m._take(n)
            seq.pages.extend(pages)
            return NeedResult(True, need.seq_id, pages)
        cost = m.cost(need)
        while not m._fits(cost):
            victim = next(reversed(m.running))
            self._preempt(victim)
            if victim == need.seq_id:
                return NeedResult(False, need.seq_id, reason="preempted: not enough pages even after "
                                  "preempting every lower-priority sequence")
        return m.grow(m.seqs[need.seq_id], need.num_tokens)

    def _admit(self, need: Admit) -> NeedResult:
        m = self.m
        if self.queue_closed:
            return NeedResult(False, reason="an earlier admission or resume was refused in this step")
        plan = m.plan_admit(need)
        if not m._fits(plan.cost):
            self.queue_closed = True
            return NeedResult(False, reason=self._shortage(plan.cost))
        result = m.admit(need, plan)
        self.fresh.add(result.seq_id)
        return result

    def _resume(self, need: Resume) -> NeedResult:
        m = self.m
        if self.queue_closed:
            return NeedResult(False, need.seq_id, reason="an earlier admission or resume was refused in this step")
        cost = m.cost(need)
        if not m._fits(cost):
            self.queue_closed = True
            return NeedResult(False, need.seq_id, reason=self._shortage(cost))
        result, copies, renodes = m.swap_in(m.seqs[need.seq_id], need.num_tokens, publish=False)
        self.resumed[need.seq_id] = (copies, renodes)
        self.fresh.add(need.seq_id)
        return result

    def _fork(self, need: Fork) -> NeedResult:
        m = self.m
        parent = need.parent_seq_id
        if parent in self.preempted:
            return NeedResult(False, reason=f"parent seq id {parent} was preempted in this step")
        # (A parent resumed in this step cannot get here: validation wants it running already.)
        cost = m.cost(need)
        if not m._fits(cost):
            return NeedResult(False, reason=self._shortage(cost))
        result, copies = m.fork(m.seqs[parent], need.request_id)
        self.plan.copies.extend(copies)
        self.fresh.add(result.seq_id)
        return result

    def _preempt(self, seq_id: int) -> None:
        m, plan = self.m, self.plan
        seq = m.seqs[seq_id]
        mode = PreemptionMode.RECOMPUTE if seq_id in self.fresh else self.req.preemption_mode
        self.resumed.pop(seq_id, None)  # its swap-in copies would land in freed pages
        applied = m.preempt(seq, mode, plan)
        plan.preempted.append(Preemption(seq_id, seq.request_id, applied))
        self.preempted.add(seq_id)
        index = self.granted.pop(seq_id, None)
        if index is not None:
            plan.results[index] = NeedResult(False, seq_id, reason="preempted by a higher-priority need")

    def _shortage(self, cost) -> str:
        m = self.m
        if cost.seq_ids > len(m.seq_ids):
            return "no free seq id"
        return f"needs {cost.pages} pages, {m.available() - cost.parked_hits} available"
