"""The prefix tree: one node per full, computed page, keyed by its chained hash.

Because each hash chains its parent's, a hash names a whole prefix, so a flat
dict (hash -> page) is the tree's index. A second index, (parent page, or the
extra_key for a first page; the page's int32 token bytes) -> page, names the same
nodes without hashing, so a prefix match is a dict lookup per page and no SHA-256.
Parent links and child counts are kept for eviction order and for checks.

Unreferenced nodes are parked. A node is *live* while a sequence references it or
any node below it; a parked node that is not live sits in an LRU list, and eviction
takes the least recently parked one first. A node leaves the LRU list when it or a
descendant is referenced again and re-enters it, at the tail, only once nothing
below it is live, so every node in the list comes after its children: eviction
takes leaves first (checked on every eviction). Normally a sequence references a
node's ancestors too, so liveness is just the refcount; a sliding window breaks
that (a sequence drops the first pages of its context, outside its attention
window, while it holds later ones), and the dropped pages stay parked but live
(*blocked*: cached, not evictable, not counted as available) until the nodes
below them are let go. The tree keeps this itself, by counting live children.
"""

from __future__ import annotations

from collections import OrderedDict

from kvserve.kvcache_service.contract.hashing import ROOT_HASH

NO_PARENT = -1


class PrefixTree:
    __slots__ = ("page_of", "hash_of", "parent_of", "children", "_lru", "child", "key_of", "_blocked", "live_below")

    def __init__(self, num_pages: int) -> None:
        self.page_of: dict[int, int] = {}                      # hash -> page
        self.hash_of: list[int | None] = [None] * num_pages    # page -> hash, None if not a node
        self.parent_of: list[int] = [NO_PARENT] * num_pages    # page -> parent page
        self.children: list[int] = [0] * num_pages             # page -> number of child nodes
        self._lru: OrderedDict[int, None] = OrderedDict()      # parked pages, oldest first
        self._blocked: set[int] = set()                        # parked pages with a live node below
        self.live_below: list[int] = [0] * num_pages           # page -> live child nodes
        self.child: dict[tuple[int | str, bytes], int] = {}    # (parent page | extra_key, token bytes) -> page
        self.key_of: list[tuple[int | str, bytes] | None] = [None] * num_pages  # page -> its key in child

    def __len__(self) -> int:
        return len(self.page_of)

    @property
    def num_evictable(self) -> int:
        return len(self._lru)

    @property
    def num_parked(self) -> int:
        return len(self._lru) + len(self._blocked)

    def get(self, h: int) -> int | None:
        return self.page_of.get(h)

    def is_node(self, page: int) -> bool:
        return self.hash_of[page] is not None

    def is_evictable(self, page: int) -> bool:
        """Parked and not blocked: counted as available, and taken by eviction."""
        return page in self._lru

    def match_bytes(self, data: bytes, width: int, extra_key: str = "") -> list[int]:
        """Pages of the longest cached prefix of the pages of `data` (int32 LE token
        bytes, `width` bytes a page), stopping at the first miss. No hashing."""
        get = self.child.get
        key: int | str = extra_key
        out: list[int] = []
        append = out.append
        for off in range(0, len(data) - width + 1, width):
            page = get((key, data[off : off + width]))
            if page is None:
                break
            append(page)
            key = page
        return out

    def insert(self, h: int, parent_hash: int, page: int, data: bytes, extra_key: str = "") -> None:
        """A newly computed full page, referenced, whose tokens' int32 LE bytes are `data`.
        The caller checked `h` is absent and the parent (unless ROOT_HASH) is a node."""
        parent = NO_PARENT if parent_hash == ROOT_HASH else self.page_of[parent_hash]
        self.page_of[h] = page
        self.hash_of[page] = h
        self.parent_of[page] = parent
        key = (extra_key if parent == NO_PARENT else parent, data)
        self.child[key] = page
        self.key_of[page] = key
        if parent != NO_PARENT:
            self.children[parent] += 1
            self._live_from(parent)

    def park(self, page: int) -> None:
        """The node's refcount dropped to 0: evictable, most recently used, unless a node below
        it is live; then each ancestor kept live only by it becomes evictable after it."""
        live_below = self.live_below
        if live_below[page]:
            self._blocked.add(page)
            return
        lru, blocked, parent_of = self._lru, self._blocked, self.parent_of
        while True:
            lru[page] = None
            page = parent_of[page]
            if page == NO_PARENT:
                return
            live_below[page] -= 1
            if live_below[page] or page not in blocked:
                return
            blocked.remove(page)

    def unpark(self, page: int) -> None:
        """The node is referenced again (and so live, with every ancestor)."""
        if page in self._blocked:
            self._blocked.remove(page)
            return
        del self._lru[page]
        parent = self.parent_of[page]
        if parent != NO_PARENT:
            self._live_from(parent)

    def _live_from(self, page: int) -> None:
        """A child of `page` became live: so do `page` and its ancestors, up to the first that
        already was."""
        live_below, lru, blocked, parent_of = self.live_below, self._lru, self._blocked, self.parent_of
        while True:
            live_below[page] += 1
            if page not in lru:
                return
            del lru[page]
            blocked.add(page)
            page = parent_of[page]
            if page == NO_PARENT:
                return

    def evict(self, n: int) -> list[tuple[int, int]]:
        """Removes the n least recently used parked nodes: [(page, hash)]."""
        out = []
        lru, hash_of, parent_of, children = self._lru, self.hash_of, self.parent_of, self.children
        for _ in range(n):
            page, _ = lru.popitem(last=False)
            if children[page]:
                raise AssertionError(f"prefix tree: evicting page {page}, which has children")
            h = hash_of[page]
            del self.page_of[h]
            hash_of[page] = None
            del self.child[self.key_of[page]]
            self.key_of[page] = None
            parent = parent_of[page]
            if parent != NO_PARENT:
                children[parent] -= 1
                parent_of[page] = NO_PARENT
            out.append((page, h))
        return out

    def parked(self) -> list[int]:
        """Parked pages: the evictable ones in eviction order, then the blocked ones."""
        return [*self._lru, *sorted(self._blocked)]

    def evictable(self) -> list[int]:
        """Parked pages that are not blocked, in eviction order."""
        return list(self._lru)

    def nodes_parent_first(self) -> list[tuple[int, int]]:
        """(hash, parent hash) of every node, parents before children."""
        depth: dict[int, int] = {}
        for page in self.page_of.values():
            d, p = 0, page
            while p != NO_PARENT and p not in depth:
                p = self.parent_of[p]
                d += 1
            depth[page] = d + (depth[p] if p != NO_PARENT else 0)
        out = []
        for page in sorted(self.page_of.values(), key=depth.__getitem__):
            parent = self.parent_of[page]
            out.append((self.hash_of[page], ROOT_HASH if parent == NO_PARENT else self.hash_of[parent]))
        return out

    def reset(self) -> None:
        n = len(self.hash_of)
        self.page_of = {}
        self.hash_of = [None] * n
        self.parent_of = [NO_PARENT] * n
        self.children = [0] * n
        self._lru = OrderedDict()
        self._blocked = set()
        self.live_below = [0] * n
        self.child = {}
        self.key_of = [None] * n
