"""Swapping a sequence's private pages to the CPU pool and back.

Swap-out moves only pages nobody else references, tail first; pages another live sequence
shares stay on the device (and a slid sequence's tree pages: _leaving). Swap-in shares pages that
are (still or again) in the tree instead of copying them back.
"""

from __future__ import annotations

from kvserve.kvcache_service.contract.types import NeedResult, SeqState
from kvserve.kvcache_service.core.commit import publish
from kvserve.kvcache_service.core.sequence import SWAPPED_OUT, Sequence, table_view
from kvserve.kvcache_service.core.state import Cost, ManagerState


def _leaving(state: ManagerState, seq: Sequence) -> list[int]:
    """The indices of the pages a swap-out moves, tail first: those nobody else references. A
    slid sequence keeps its tree pages on the device: it could only take them back as private
    copies (holding a node again would need its dropped ancestors blocked again), and a copy
    between tree pages would break the rule that its tree pages come first."""
    ref, pages, is_node = state.pool.ref, seq.pages, state.tree.is_node
    return [i for i in range(len(pages) - 1, -1, -1)
            if pages[i] >= 0 and ref[pages[i]] == 1 and not (seq.slid and is_node(pages[i]))]


def swap_out_cost(state: ManagerState, seq: Sequence) -> int:
    """CPU pages a swap-out takes."""
    return len(_leaving(state, seq))


def swap_out(state: ManagerState, seq: Sequence) -> list[tuple[int, int]]:
    """Moves the private pages, tail first, to the CPU pool. The caller checked it has room."""
    private = _leaving(state, seq)
    copies = []
    for i, cpu_page in zip(private, state.cpu.take(len(private))):
        page = seq.pages[i]
        copies.append((page, cpu_page))
        seq.swapped.append((i, cpu_page, state.tree.is_node(page)))
        seq.pages[i] = SWAPPED_OUT
        state.drop(page)  # a tree page stays cached on the device: swap-in may find it there
    seq.state = SeqState.SWAPPED
    state.running.pop(seq.seq_id, None)
    state.swapped[seq.seq_id] = None
    return copies


def _resume_split(state: ManagerState, seq: Sequence) -> tuple[list[tuple[int, int, bool]], list[tuple[int, int]], int]:
    """Swapped pages needing a copy back, pages found in the tree meanwhile
    (index, page), and how many of those are parked."""
    copies, hits = [], []
    page_of, ref = state.tree.page_of, state.pool.ref
    for entry in seq.swapped:
        index, _, was_node = entry
        # (A slid sequence swapped no tree page out, _leaving: it slid while running.)
        page = page_of.get(seq.hashes[index]) if was_node else None
        if page is None:
            copies.append(entry)
        else:
            hits.append((index, page))
    parked = sum(1 for _, page in hits if ref[page] == 0 and state.tree.is_evictable(page))
    return copies, hits, parked


def resume_cost(state: ManagerState, seq: Sequence, num_tokens: int) -> Cost:
    copies, _, parked = _resume_split(state, seq)
    grow = max(0, -(-num_tokens // state.page_size) - len(seq.pages))
    return Cost(len(copies) + grow, parked)


def swap_in(state: ManagerState, seq: Sequence, num_tokens: int = 0,
            publish_now: bool = True) -> tuple[NeedResult, list[tuple[int, int]], list[int]]:
    """Brings a swapped sequence back, with slots for num_tokens (0: those it held); pages that
    entered the tree meanwhile are shared instead of copied. The caller checked the cost fits.

    Copied pages that were tree nodes go back into the tree: at once with `publish_now`, else
    the caller publishes the returned indices once it knows the copies will run (a Step may
    still preempt the sequence)."""
    to_copy, hits, _ = _resume_split(state, seq)
    for index, page in hits:
        state.hold(page)
        seq.pages[index] = page
    new_pages = iter(state.take(len(to_copy)))
    copies, renodes = [], []
    for index, cpu_page, was_node in sorted(to_copy):
        page = next(new_pages)
        copies.append((cpu_page, page))
        seq.pages[index] = page
        if was_node:
            renodes.append(index)
    if publish_now:
        publish(state, seq, renodes)
    state.cpu.put_later([cpu_page for _, cpu_page, _ in seq.swapped])
    seq.swapped = []
    seq.state = SeqState.RUNNING
    del state.swapped[seq.seq_id]
    state.running[seq.seq_id] = None
    result = NeedResult(True, seq.seq_id, table_view(seq.pages), True)
    if num_tokens:
        result.page_ids.extend(state.grow(seq, num_tokens))
    return result, copies, renodes
