"""Serving one need: what it costs, and the act that serves it.

    cost_of(need)  ->  state.fits(cost)?  ->  allocate(need)

Step (step.py) and the fine-grained calls (manager.py) both go through these; Step adds its
policy (priority order, preemption) around them. allocate never checks again what cost_of and
fits said: the caller checked, and the state has not changed in between.
"""

from __future__ import annotations

from kvserve.kvcache_service.contract.types import Admit, Allocation, Grow, Need, NeedResult, Resume
from kvserve.kvcache_service.core import admission, swap
from kvserve.kvcache_service.core.sequence import Sequence, table_view
from kvserve.kvcache_service.core.state import Cost, ManagerState


def cost_of(state: ManagerState, need: Need) -> Cost:
    """Pages and seq ids serving a valid need takes now."""
    ps = state.page_size
    if isinstance(need, Grow):
        return Cost(max(0, -(-need.num_tokens // ps) - len(state.seqs[need.seq_id].pages)))
    if isinstance(need, Admit):
        return admission.match(state, need).cost
    if isinstance(need, Resume):
        return swap.resume_cost(state, state.seqs[need.seq_id], need.num_tokens)
    parent = state.seqs[need.parent_seq_id]
    shared = parent.num_computed // ps   # full pages: shared; the partial one and any beyond: new
    return Cost(max(-(-parent.num_computed // ps), -(-need.num_tokens // ps)) - shared, 0, 1)


def allocate(state: ManagerState, need: Need) -> Allocation:
    """Serves a need whose cost fits, without preempting anybody."""
    if isinstance(need, Grow):
        return Allocation(grow(state, state.seqs[need.seq_id], need.num_tokens), [], [])
    if isinstance(need, Admit):
        return Allocation(admission.admit(state, need, admission.match(state, need)), [], [])
    if isinstance(need, Resume):
        result, swap_in, _ = swap.swap_in(state, state.seqs[need.seq_id], need.num_tokens)
        return Allocation(result, swap_in, [])
    result, copies = fork(state, state.seqs[need.parent_seq_id], need.request_id, need.num_tokens)
    return Allocation(result, [], copies)


def grow(state: ManagerState, seq: Sequence, num_tokens: int) -> NeedResult:
    """Slots for positions 0 .. num_tokens-1: the pages appended."""
    return NeedResult(True, seq.seq_id, state.grow(seq, num_tokens))


def fork(state: ManagerState, parent: Sequence, request_id: str,
         num_tokens: int = 0) -> tuple[NeedResult, list[tuple[int, int]]]:
    """A child sharing the parent's full computed pages; the partial one is copied, and pages
    are added so the child has slots for num_tokens."""
    ps = state.page_size
    full, partial = divmod(parent.num_computed, ps)
    seq_id = state.seq_ids.acquire()
    child = Sequence(seq_id, request_id, parent.extra_key, list(parent.tokens))
    child.pages = parent.pages[:full]
    for page in child.pages:
        if page >= 0:   # not one a slide dropped
            state.hold(page)
    copies = []
    if partial:
        (page,) = state.take(1)
        copies.append((parent.pages[full], page))
        child.pages.append(page)
    child.num_computed = parent.num_computed
    child.hashes = parent.hashes[:full]
    child.num_published = min(parent.num_published, full)
    if parent.diverged_at is not None and parent.diverged_at < full:
        child.diverged_at = parent.diverged_at
    child.cached_tokens = parent.cached_tokens
    child.slid = parent.slid
    state.grow(child, num_tokens)
    state.add(child)
    return NeedResult(True, seq_id, table_view(child.pages), True), copies
