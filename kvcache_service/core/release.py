"""Giving pages back: a whole sequence (release), its last tokens (truncate) or its first
pages (slide).

Each walks the page table from its tail, so a sequence's tree pages park leaves before
parents (the tree orders eviction leaves first either way: PrefixTree).
"""

from __future__ import annotations

from kvserve.kvcache_service.core.sequence import DROPPED, Sequence
from kvserve.kvcache_service.core.state import ManagerState


def release(state: ManagerState, seq: Sequence, defer_id: bool = False) -> tuple[int, int]:
    """Ends a sequence now; its CPU pages (and, with defer_id, its seq id) are freed at the
    end of the call. Returns (pages freed, pages left cached)."""
    freed = cached = 0
    ref, free, hash_of, park = state.pool.ref, state.pool.free, state.tree.hash_of, state.tree.park
    for page in reversed(seq.pages):  # tail first: leaves park before parents (state.drop, inlined)
        if page < 0:   # SWAPPED_OUT or DROPPED: not on the device, or no longer its
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
        state.cpu.put_later([cpu_page for _, cpu_page, _ in seq.swapped])
    state.forget(seq, defer_id)
    return freed, cached


def truncate_cost(state: ManagerState, seq: Sequence, num_tokens: int) -> int:
    """1 when the new last page is partial and shared (it must be copied), else 0."""
    new_len = len(seq.tokens) - num_tokens
    keep = -(-new_len // state.page_size)
    if new_len % state.page_size == 0 or keep > len(seq.pages):
        return 0
    last = seq.pages[keep - 1]
    return 1 if (state.tree.is_node(last) or state.pool.ref[last] > 1) else 0


def truncate_gain(state: ManagerState, seq: Sequence, num_tokens: int) -> int:
    """Pages a truncation makes available before it takes its copy page: the
    dropped pages nobody else references (each is freed or parked)."""
    keep = -(-(len(seq.tokens) - num_tokens) // state.page_size)
    ref = state.pool.ref
    return sum(1 for page in seq.pages[keep:] if page >= 0 and ref[page] == 1)


def truncate(state: ManagerState, seq: Sequence, num_tokens: int) -> tuple[int, list[tuple[int, int]]]:
    """Drops the last num_tokens tokens and exactly the pages past the new end.
    Returns (pages freed, copies). The caller checked the copy's page fits."""
    ps = state.page_size
    copy_needed = truncate_cost(state, seq, num_tokens)
    new_len = len(seq.tokens) - num_tokens
    keep = -(-new_len // ps)
    freed = 0
    for page in reversed(seq.pages[keep:]):
        if page >= 0:
            freed += state.drop(page)
    del seq.pages[keep:]
    copies = []
    if copy_needed:  # a shared or cached page becomes our last, partial one: write a copy
        last = seq.pages[keep - 1]
        (page,) = state.take(1)
        copies.append((last, page))
        seq.pages[keep - 1] = page
        freed += state.drop(last)
    full = new_len // ps
    del seq.tokens[new_len:]
    del seq.hashes[full:]
    seq.num_computed = min(seq.num_computed, new_len)
    seq.num_published = min(seq.num_published, full)
    if seq.diverged_at is not None and seq.diverged_at >= full:
        seq.diverged_at = None
    return freed, copies


def slide(state: ManagerState, seq: Sequence, first_page: int, end_page: int) -> int:
    """Pages [first_page, end_page) leave the sequence (outside its attention window), tail first
    so that tree pages park leaves before parents; from now on it stores nothing in the tree.
    A tree page it drops stays cached; while it holds a tree page below it, the tree keeps that
    one blocked (PrefixTree). Returns the pages freed."""
    pages = seq.pages
    freed = 0
    for i in range(end_page - 1, first_page - 1, -1):
        page = pages[i]
        if page == DROPPED:   # a slide may end inside pages an earlier one dropped
            continue
        pages[i] = DROPPED
        freed += state.drop(page)
    seq.slid = True
    return freed
