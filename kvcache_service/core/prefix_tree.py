"""The prefix tree: one node per full, computed page, keyed by its chained hash.

Because each hash chains its parent's, a hash names a whole prefix, so a flat
dict (hash -> page) is the tree's index. A second index, (parent page, or the
extra_key for a first page; the page's int32 token bytes) -> page, names the same
nodes without hashing, so a prefix match is a dict lookup per page and no SHA-256.
Parent links and child counts are kept for eviction order and for checks.

Unreferenced nodes are parked in an LRU list. Eviction takes the least
recently parked node first; the manager parks a sequence's pages tail first,
and a node referenced by a sequence always has its ancestors referenced by the
same sequence, so the LRU head is always a leaf: a parent is evicted only after
its children (checked on every eviction). The one exception is a sliding window:
a sequence that dropped the first pages of its context (outside its attention
window) while it holds later ones *blocks* the dropped ones; a blocked node parks
apart, not evictable and not counted as available, until the sequence lets go of
its later pages too and unblocks it.
"""

from __future__ import annotations

from collections import OrderedDict

from kvserve.kvcache_service.contract.hashing import ROOT_HASH

NO_PARENT = -1


class PrefixTree:
    __slots__ = ("page_of", "hash_of", "parent_of", "children", "_lru", "child", "key_of", "_blocked", "blocks")

    def __init__(self, num_pages: int) -> None:
        self.page_of: dict[int, int] = {}                      # hash -> page
        self.hash_of: list[int | None] = [None] * num_pages    # page -> hash, None if not a node
        self.parent_of: list[int] = [NO_PARENT] * num_pages    # page -> parent page
        self.children: list[int] = [0] * num_pages             # page -> number of child nodes
        self._lru: OrderedDict[int, None] = OrderedDict()      # parked pages, oldest first
        self._blocked: set[int] = set()                        # parked pages a sliding sequence blocks
        self.blocks: list[int] = [0] * num_pages               # page -> sliding sequences blocking it
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
        """A newly computed full page whose tokens' int32 LE bytes are `data`. The
        caller checked `h` is absent and the parent (unless ROOT_HASH) is a node."""
        parent = NO_PARENT if parent_hash == ROOT_HASH else self.page_of[parent_hash]
        self.page_of[h] = page
        self.hash_of[page] = h
        self.parent_of[page] = parent
        key = (extra_key if parent == NO_PARENT else parent, data)
        self.child[key] = page
        self.key_of[page] = key
        if parent != NO_PARENT:
            self.children[parent] += 1

    def park(self, page: int) -> None:
        """The node's refcount dropped to 0: evictable, most recently used (unless blocked)."""
        if self.blocks[page]:
            self._blocked.add(page)
        else:
            self._lru[page] = None

    def unpark(self, page: int) -> None:
        """The node is referenced again."""
        if page in self._blocked:
            self._blocked.remove(page)
        else:
            del self._lru[page]

    def block(self, page: int) -> None:
        """A sliding sequence dropped this node while it holds nodes below it."""
        self.blocks[page] += 1
        if page in self._lru:
            del self._lru[page]
            self._blocked.add(page)

    def unblock(self, page: int) -> None:
        """The sequence let go of the nodes below it: evictable (most recently used) once parked."""
        self.blocks[page] -= 1
        if not self.blocks[page] and page in self._blocked:
            self._blocked.remove(page)
            self._lru[page] = None

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
        self.blocks = [0] * n
        self.child = {}
        self.key_of = [None] * n
