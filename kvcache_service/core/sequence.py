"""The manager's record of one sequence."""

from __future__ import annotations

from kvserve.kvcache_service.contract.types import SeqState

SWAPPED_OUT = -1  # a page-table entry whose page sits in the CPU pool
DROPPED = -2      # a page-table entry whose page left by a slide (outside the attention window)


def table_view(pages: list[int]) -> list[int]:
    """A page table as callers get it: a page that left by a slide reads 0 (never read: it is
    outside the window)."""
    return [p if p != DROPPED else 0 for p in pages]


class Sequence:
    """KV state of one request.

    pages[i] holds tokens i*page_size .. (i+1)*page_size-1. The tree pages of a
    sequence always form a prefix of its table: pages[:n] are tree nodes and
    later ones are private (not yet full, not yet committed, or duplicates of
    a node another sequence stored first: `diverged_at`).
    """

    __slots__ = (
        "seq_id", "request_id", "extra_key", "tokens", "num_computed", "pages", "hashes",
        "num_published", "diverged_at", "state", "swapped", "cached_tokens", "slid",
    )

    def __init__(self, seq_id: int, request_id: str, extra_key: str, tokens: list[int]) -> None:
        self.seq_id = seq_id
        self.request_id = request_id
        self.extra_key = extra_key
        self.tokens = tokens                 # every token the manager knows of
        self.num_computed = 0                # tokens whose K/V are written
        self.pages: list[int] = []
        self.hashes: list[int] = []          # hashes of leading full pages, as far as computed
        self.num_published = 0               # leading full pages already offered to the tree
        self.diverged_at: int | None = None  # first page that duplicated a node: no inserts from there
        self.state = SeqState.RUNNING
        self.swapped: list[tuple[int, int, bool]] = []  # (index, cpu page, was a tree node)
        self.cached_tokens = 0               # served from the tree at admission
        self.slid = False                    # a slide dropped pages: it stores nothing more in the tree

    def held(self) -> list[int]:
        """Its device pages (not swapped out, not dropped)."""
        return [p for p in self.pages if p >= 0]

    def parent_hash(self, index: int) -> int:
        return self.hashes[index - 1] if index else 0
