"""Giving pages back: a whole sequence (release), its last tokens (truncate) or its first
pages (slide).

Each walks the page table from its tail, so a sequence's tree pages park leaves before
parents (the tree orders eviction leaves first either way: PrefixTree).
"""

from __future__ import annotations

from kvserve.kvcache_service.core.prefix_tree import NO_PARENT
from kvserve.kvcache_service.core.sequence import DROPPED, Sequence
from kvserve.kvcache_service.core.state import ManagerState


class DropForecast:
    """Pages a run of drops will make available, worked out before any is made (validation
    checks a Step whole before it changes anything). A page whose last reference goes is
    available if it is freed, or parks evictable; a tree page that parks while a node below it
    is live (after a slide) parks blocked and is not, until that node is let go, when it and
    every ancestor kept live only by it become available (as PrefixTree.park does)."""

    __slots__ = ("state", "refs", "lost_below")

    def __init__(self, state: ManagerState) -> None:
        self.state = state
        self.refs: dict[int, int] = {}        # page -> references dropped so far
        self.lost_below: dict[int, int] = {}  # page -> live children it lost so far

    def drop(self, page: int) -> int:
        """One reference to `page` dropped: the pages it makes available."""
        state, refs = self.state, self.refs
        refs[page] = dropped = refs.get(page, 0) + 1
        if state.pool.ref[page] > dropped:
            return 0
        tree = state.tree
        if not tree.is_node(page):
            return 1
        lost, live_below, parent_of, ref = self.lost_below, tree.live_below, tree.parent_of, state.pool.ref
        if live_below[page] > lost.get(page, 0):
            return 0   # parks blocked
        gained = 1
        parent = parent_of[page]
        while parent != NO_PARENT:
            lost[parent] = lost.get(parent, 0) + 1
            if live_below[parent] > lost[parent] or ref[parent] > refs.get(parent, 0):
                break   # still live: a child or a reference holds it
            gained += 1   # it was parked blocked by this child alone: evictable now
            parent = parent_of[parent]
        return gained


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


def truncate_cost(state: ManagerState, seq: Sequence, num_tokens: int, forecast: DropForecast | None = None) -> int:
    """1 when the new last page is partial and shared (it must be copied), else 0; shared as it
    will be after the drops `forecast` has seen (a Step's earlier releases and truncations)."""
    new_len = len(seq.tokens) - num_tokens
    keep = -(-new_len // state.page_size)
    if new_len % state.page_size == 0 or keep > len(seq.pages):
        return 0
    last = seq.pages[keep - 1]
    refs = state.pool.ref[last] - (forecast.refs.get(last, 0) if forecast is not None else 0)
    return 1 if (state.tree.is_node(last) or refs > 1) else 0


def release_gain(forecast: DropForecast, seq: Sequence) -> int:
    """Pages releasing `seq` makes available (after the drops `forecast` has seen)."""
    return sum(forecast.drop(page) for page in reversed(seq.pages) if page >= 0)


def truncate_gain(state: ManagerState, seq: Sequence, num_tokens: int, forecast: DropForecast | None = None) -> int:
    """Pages a truncation makes available before it takes its copy page (after the drops
    `forecast` has seen)."""
    keep = -(-(len(seq.tokens) - num_tokens) // state.page_size)
    forecast = forecast if forecast is not None else DropForecast(state)
    return sum(forecast.drop(page) for page in reversed(seq.pages[keep:]) if page >= 0)


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
