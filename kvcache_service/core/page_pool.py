"""Device pages: refcounts and the free list. Knows nothing of hashes or sequences."""

from __future__ import annotations

from collections import deque


class PagePool:
    """`num_pages` page ids with refcounts.

    A page is free (refcount 0, in `free`), referenced (refcount > 0), or cached:
    refcount 0 but held by the prefix tree, which parks it until it is evicted.
    Allocation takes free pages from the head of the free list; freed pages go
    to its tail, so ids are handed out in a deterministic FIFO order.
    """

    __slots__ = ("num_pages", "ref", "free")

    def __init__(self, num_pages: int) -> None:
        self.num_pages = num_pages
        self.ref = [0] * num_pages
        self.free: deque[int] = deque(range(num_pages))

    def take(self, n: int) -> list[int]:
        """n free pages, each with refcount 1. The caller checked len(free) >= n."""
        free, ref = self.free, self.ref
        pages = [free.popleft() for _ in range(n)]
        for page in pages:
            ref[page] = 1
        return pages

    def put(self, page: int) -> None:
        self.free.append(page)

    def reset(self) -> None:
        self.ref = [0] * self.num_pages
        self.free = deque(range(self.num_pages))


class CpuPool:
    """CPU swap pages: a free list; freed pages wait until the end of a Step.

    Deferring frees keeps a page that is the source of a planned swap-in copy
    from being chosen as the destination of a swap-out copy in the same Step.
    """

    __slots__ = ("num_pages", "free", "pending")

    def __init__(self, num_pages: int) -> None:
        self.num_pages = num_pages
        self.free: deque[int] = deque(range(num_pages))
        self.pending: list[int] = []

    def take(self, n: int) -> list[int]:
        return [self.free.popleft() for _ in range(n)]

    def put_later(self, pages: list[int]) -> None:
        self.pending.extend(pages)

    def settle(self) -> None:
        """End of a Step (or of a fine-grained call): deferred frees become free."""
        if self.pending:
            self.free.extend(self.pending)
            self.pending.clear()

    def reset(self) -> None:
        self.free = deque(range(self.num_pages))
        self.pending = []
