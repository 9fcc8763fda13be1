"""check_invariants(state): the manager's whole state (KVCacheManager.state) is consistent.

Called after every public call (and, with mid_step=True, from inside a Step).
It reads the core's internals on purpose: the point is to catch a corrupted
state as soon as it appears, not only when it changes an answer. Every failure
is an AssertionError whose message names the broken rule.
"""

from __future__ import annotations

import struct
from collections import Counter

from kvserve.kvcache_service.contract.hashing import ROOT_HASH, page_hashes
from kvserve.kvcache_service.core.state import ManagerState
from kvserve.kvcache_service.core.prefix_tree import NO_PARENT
from kvserve.kvcache_service.core.sequence import DROPPED, SWAPPED_OUT
from kvserve.kvcache_service.contract.types import SeqState


def _fail(msg: str) -> None:
    raise AssertionError(msg)


def check_invariants(state: ManagerState, *, mid_step: bool = False) -> None:
    _check_pages(state)
    _check_seq_ids(state, mid_step)
    _check_sequences(state)
    _check_cpu(state, mid_step)
    _check_tree(state)
    _check_sequence_tree_links(state)
    _check_stats(state)


# --------------------------------------------------------------------- pages

def _check_pages(state: ManagerState) -> None:
    n = state.pool.num_pages
    ref = state.pool.ref
    free = list(state.pool.free)
    parked = state.tree.parked()
    if len(ref) != n:
        _fail(f"refcount array has {len(ref)} entries for {n} pages")
    dup = [p for p, c in Counter(free).items() if c > 1]
    if dup:
        _fail(f"pages {dup} are in the free list more than once")
    dup = [p for p, c in Counter(parked).items() if c > 1]
    if dup:
        _fail(f"pages {dup} are parked (LRU) more than once")
    free_set, parked_set = set(free), set(parked)
    for p in free:
        if not 0 <= p < n:
            _fail(f"free list holds page id {p} outside 0..{n - 1}")
        if ref[p] != 0:
            _fail(f"free page {p} has refcount {ref[p]}")
        if state.tree.is_node(p):
            _fail(f"free page {p} is a prefix-tree node")
    for p in parked:
        if not 0 <= p < n:
            _fail(f"LRU holds page id {p} outside 0..{n - 1}")
        if not state.tree.is_node(p):
            _fail(f"parked page {p} is not a prefix-tree node")
        if ref[p] != 0:
            _fail(f"parked page {p} has refcount {ref[p]}")
    for p in range(n):
        if ref[p] < 0:
            _fail(f"page {p} has negative refcount {ref[p]}")
        where = [name for name, yes in (("free", p in free_set), ("referenced", ref[p] > 0),
                                        ("parked", p in parked_set)) if yes]
        if len(where) != 1:
            _fail(f"page {p} must be exactly one of free/referenced/parked, is {where or 'none'} "
                  f"(ref={ref[p]}, node={state.tree.is_node(p)})")
    # Refcounts are exactly the page-table entries of live sequences (a stronger
    # form of "the sum of refcounts equals the number of entries").
    entries: Counter[int] = Counter()
    for seq in state.seqs.values():
        for p in seq.pages:
            if p in (SWAPPED_OUT, DROPPED):
                continue
            if not 0 <= p < n:
                _fail(f"seq {seq.seq_id} page table holds page id {p} outside 0..{n - 1}")
            entries[p] += 1
    if sum(ref) != sum(entries.values()):
        _fail(f"sum of refcounts {sum(ref)} != {sum(entries.values())} page-table entries")
    for p in range(n):
        if ref[p] != entries[p]:
            _fail(f"page {p} has refcount {ref[p]} but appears in {entries[p]} page-table entries")
        if entries[p] and p in free_set:
            _fail(f"page {p} is in a live page table and in the free list")
    if not state.seqs and any(ref):
        _fail(f"no sequence is live but pages {[p for p in range(n) if ref[p]]} are referenced")
    evictable = state.tree.evictable()
    if state.available() != len(free) + len(evictable):
        _fail(f"available() {state.available()} != free {len(free)} + evictable {len(evictable)}")
    # Parked pages are evictable exactly when no node below them is live.
    for p in set(parked) - set(evictable):
        if not state.tree.live_below[p]:
            _fail(f"parked page {p} is blocked, but no node below it is live")
    for p in evictable:
        if state.tree.live_below[p]:
            _fail(f"page {p} is evictable, but {state.tree.live_below[p]} nodes below it are live")


# ------------------------------------------------------------------- seq ids

def _check_seq_ids(state: ManagerState, mid_step: bool) -> None:
    pool = state.seq_ids
    free_ids = pool.free_ids()
    in_use = pool.in_use()
    pending = list(state.pending_seq_ids)
    if pending and not mid_step:
        _fail(f"seq ids {pending} are still pending after a public call")
    if len(free_ids) != len(set(free_ids)):
        _fail(f"free seq ids hold duplicates: {free_ids}")
    if set(free_ids) & in_use:
        _fail(f"seq ids {sorted(set(free_ids) & in_use)} are both free and in use")
    if set(free_ids) | in_use != set(range(pool.max_seqs)):
        _fail(f"free {sorted(free_ids)} and in-use {sorted(in_use)} seq ids do not cover "
              f"range({pool.max_seqs})")
    if len(pending) != len(set(pending)) or set(pending) & set(state.seqs):
        _fail(f"pending seq ids {pending} overlap live ones {sorted(state.seqs)} or repeat")
    if in_use != set(state.seqs) | set(pending):
        _fail(f"seq ids in use {sorted(in_use)} != live {sorted(state.seqs)} + pending {pending}")


# ----------------------------------------------------------------- sequences

def _check_sequences(state: ManagerState) -> None:
    ps = state.page_size
    if len(state.by_request) != len(state.seqs):
        _fail(f"{len(state.by_request)} request ids for {len(state.seqs)} sequences")
    for rid, sid in state.by_request.items():
        seq = state.seqs.get(sid)
        if seq is None or seq.request_id != rid:
            _fail(f"request id {rid!r} maps to seq id {sid}, which is "
                  f"{'unknown' if seq is None else repr(seq.request_id)}")
    running = {sid for sid, s in state.seqs.items() if s.state is SeqState.RUNNING}
    if set(state.running) != running:
        _fail(f"running order {list(state.running)} != running sequences {sorted(running)}")
    swapped = {sid for sid, s in state.seqs.items() if s.state is SeqState.SWAPPED}
    if set(state.swapped) != swapped:
        _fail(f"swap order {list(state.swapped)} != swapped sequences {sorted(swapped)}")
    for sid, seq in state.seqs.items():
        if seq.seq_id != sid:
            _fail(f"seqs[{sid}] has seq_id {seq.seq_id}")
        if not seq.tokens:
            _fail(f"seq {sid} has no tokens")
        if not 0 <= seq.num_computed <= len(seq.tokens):
            _fail(f"seq {sid}: num_computed {seq.num_computed} outside 0..{len(seq.tokens)}")
        if len(seq.pages) * ps < seq.num_computed:
            _fail(f"seq {sid}: {len(seq.pages)} pages ({len(seq.pages) * ps} slots) cannot hold its "
                  f"{seq.num_computed} computed tokens")
        device = [p for p in seq.pages if p >= 0]
        if len(device) != len(set(device)):
            _fail(f"seq {sid}: a page appears twice in its table {seq.pages}")
        if seq.num_published > seq.num_computed // ps:
            _fail(f"seq {sid}: {seq.num_published} pages published but only "
                  f"{seq.num_computed // ps} full pages computed")
        if len(seq.hashes) < seq.num_published:
            _fail(f"seq {sid}: {len(seq.hashes)} hashes for {seq.num_published} published pages")
        if len(seq.hashes) * ps > len(seq.tokens):
            _fail(f"seq {sid}: {len(seq.hashes)} page hashes but only {len(seq.tokens)} tokens")
        expected = page_hashes(seq.tokens[: len(seq.hashes) * ps], ps, seq.extra_key)
        if seq.hashes != expected:
            _fail(f"seq {sid}: stored page hashes do not match its tokens")
        if seq.state is SeqState.RUNNING:
            if seq.swapped or SWAPPED_OUT in seq.pages:
                _fail(f"running seq {sid} has swapped pages {seq.swapped} / table {seq.pages}")
            # The engine writes positions >= num_computed: those pages must be its own.
            for i in range(seq.num_computed // ps, len(seq.pages)):
                p = seq.pages[i]
                if state.pool.ref[p] != 1 or state.tree.is_node(p):
                    _fail(f"running seq {sid}: page {p} at index {i} holds writable slots "
                          f"(num_computed={seq.num_computed}) but is shared (ref={state.pool.ref[p]}) "
                          f"or a tree node ({state.tree.is_node(p)})")
        else:
            slots = sorted(i for i, p in enumerate(seq.pages) if p == SWAPPED_OUT)
            if sorted(i for i, _, _ in seq.swapped) != slots:
                _fail(f"swapped seq {sid}: swapped entries {seq.swapped} do not match the "
                      f"SWAPPED_OUT slots {slots} of {seq.pages}")


def _check_cpu(state: ManagerState, mid_step: bool) -> None:
    cpu = state.cpu
    held = [c for s in state.seqs.values() for _, c, _ in s.swapped]
    parts = list(cpu.free) + list(cpu.pending) + held
    if cpu.pending and not mid_step:
        _fail(f"CPU pages {cpu.pending} are still pending after a public call")
    if sorted(parts) != list(range(cpu.num_pages)):
        c = Counter(parts)
        _fail(f"CPU pages free {list(cpu.free)} + pending {cpu.pending} + held {held} do not "
              f"partition range({cpu.num_pages}) (repeated: {[p for p in c if c[p] > 1]})")


# ---------------------------------------------------------------------- tree

def _check_tree(state: ManagerState) -> None:
    tree, ref = state.tree, state.pool.ref
    n = state.pool.num_pages
    for h, p in tree.page_of.items():
        if not 0 <= p < n or tree.hash_of[p] != h:
            _fail(f"tree: page_of[{h:#x}] = {p} but hash_of[{p}] = {tree.hash_of[p] if 0 <= p < n else '?'}")
    nodes = [p for p in range(n) if tree.hash_of[p] is not None]
    if len(nodes) != len(tree.page_of):
        _fail(f"tree: {len(nodes)} pages have a hash but the index holds {len(tree.page_of)}")
    for p in nodes:
        if tree.page_of.get(tree.hash_of[p]) != p:
            _fail(f"tree: hash_of[{p}] is not indexed back to page {p}")
    counts: Counter[int] = Counter()
    for p in nodes:
        parent = tree.parent_of[p]
        if parent == NO_PARENT:
            continue
        if not 0 <= parent < n or tree.hash_of[parent] is None:
            _fail(f"tree: node {p}'s parent {parent} is not a node")
        counts[parent] += 1
    for p in range(n):
        if tree.children[p] != counts[p]:
            _fail(f"tree: page {p} counts {tree.children[p]} children, has {counts[p]}")
        if tree.hash_of[p] is None and tree.parent_of[p] != NO_PARENT:
            _fail(f"tree: page {p} is not a node but keeps parent {tree.parent_of[p]}")
        if tree.hash_of[p] is None and tree.live_below[p]:
            _fail(f"tree: page {p} is not a node but counts {tree.live_below[p]} live children")
    parked = set(tree.parked())
    # Live: referenced, or a live node below. live_below counts live children; the evictable
    # (not live) nodes come after all their children in eviction order.
    live = [False] * n
    want_below: Counter[int] = Counter()
    for p in sorted(nodes, key=lambda p: -_depth(tree, p)):   # children before parents
        live[p] = ref[p] > 0 or want_below[p] > 0
        if live[p] and tree.parent_of[p] != NO_PARENT:
            want_below[tree.parent_of[p]] += 1
    for p in nodes:
        if ref[p] == 0 and p not in parked:
            _fail(f"tree: node {p} has refcount 0 but is not parked (never evictable)")
        if tree.live_below[p] != want_below[p]:
            _fail(f"tree: node {p} counts {tree.live_below[p]} live children, has {want_below[p]}")
    position = {p: i for i, p in enumerate(tree.evictable())}
    for p, i in position.items():
        parent = tree.parent_of[p]
        if position.get(parent, i) < i:
            _fail(f"tree: evictable node {p} comes after its parent {parent} in eviction order")
    if tree.num_evictable != len(tree.evictable()) or tree.num_parked != len(parked):
        _fail(f"tree: num_evictable {tree.num_evictable} / num_parked {tree.num_parked} != "
              f"{len(tree.evictable())} evictable / {len(parked)} parked")
    _check_byte_index(state, nodes)


def _depth(tree, page: int) -> int:
    d = 0
    while tree.parent_of[page] != NO_PARENT:
        page = tree.parent_of[page]
        d += 1
    return d


def _check_byte_index(state: ManagerState, nodes: list[int]) -> None:
    """The tree's second index, (parent page, or extra_key for a first page; the
    page's token bytes) -> page, where the tree has one: it names exactly the nodes."""
    tree = state.tree
    child, key_of = getattr(tree, "child", None), getattr(tree, "key_of", None)
    if child is None or key_of is None:
        return
    if len(child) != len(nodes):
        _fail(f"tree: byte index holds {len(child)} keys for {len(nodes)} nodes")
    for p in range(state.pool.num_pages):
        key = key_of[p]
        if tree.hash_of[p] is None:
            if key is not None:
                _fail(f"tree: page {p} is not a node but keeps byte-index key {key!r}")
            continue
        if key is None or child.get(key) != p:
            _fail(f"tree: node {p} is not indexed by its byte key {key!r}")
        parent = tree.parent_of[p]
        if (parent == NO_PARENT) != isinstance(key[0], str) or (parent != NO_PARENT and key[0] != parent):
            _fail(f"tree: node {p} has parent {parent} but byte key {key[0]!r}")
        if len(key[1]) != 4 * state.page_size:
            _fail(f"tree: node {p}'s byte key holds {len(key[1])} bytes, a page is {4 * state.page_size}")


def _check_sequence_tree_links(state: ManagerState) -> None:
    """A sequence's tree pages are a prefix of its table (counting the pages a slide dropped
    from it and the tree pages it swapped out), each the child of the page before it, holding
    exactly the sequence's own page hash. The parent of a tree page after an absent one is still
    in the tree, live (held or blocked)."""
    tree = state.tree
    ps = state.page_size
    for sid, seq in state.seqs.items():
        swapped_nodes = {i for i, _, was_node in seq.swapped if was_node}
        absent = [p == DROPPED or i in swapped_nodes for i, p in enumerate(seq.pages)]
        is_node = [a or (p >= 0 and tree.is_node(p)) for a, p in zip(absent, seq.pages)]
        k = is_node.index(False) if False in is_node else len(is_node)
        if any(x and not absent[i] for i, x in enumerate(is_node[k:], k)):
            _fail(f"seq {sid}: tree pages are not a prefix of its table {seq.pages} "
                  f"(nodes at {[i for i, x in enumerate(is_node) if x]})")
        if DROPPED in seq.pages and not seq.slid:
            _fail(f"seq {sid}: pages were dropped but it is not marked slid")
        held = [i for i in range(k) if not absent[i]]
        if held and held[-1] + 1 > seq.num_computed // ps:
            _fail(f"seq {sid}: tree page at {held[-1]} but only {seq.num_computed} tokens computed")
        if seq.diverged_at is not None and held and held[-1] >= seq.diverged_at:
            _fail(f"seq {sid}: diverged at page {seq.diverged_at} but holds tree page {held[-1]}")
        for i in held:
            p = seq.pages[i]
            if i >= len(seq.hashes) or tree.hash_of[p] != seq.hashes[i]:
                _fail(f"seq {sid}: tree page {p} at index {i} has hash {tree.hash_of[p]:#x}, "
                      f"not the sequence's own page hash")
            if i == 0:
                want = NO_PARENT
            elif not absent[i - 1]:
                want = seq.pages[i - 1]
            else:
                want = tree.page_of.get(seq.hashes[i - 1])
                if want is None or not tree.live_below[want] and state.pool.ref[want] == 0:
                    _fail(f"seq {sid}: tree page {p} at index {i} follows a dropped or swapped-out "
                          f"page whose node is neither blocked nor held")
            if tree.parent_of[p] != want:
                _fail(f"seq {sid}: tree page {p} at index {i} has parent {tree.parent_of[p]}, "
                      f"expected {want}")
            key_of = getattr(tree, "key_of", None)
            if key_of is not None:
                want_key = (seq.extra_key if i == 0 else want,
                            struct.pack(f"<{ps}i", *seq.tokens[i * ps:(i + 1) * ps]))
                if key_of[p] != want_key:
                    _fail(f"seq {sid}: tree page {p} at index {i} is indexed under {key_of[p]!r}, "
                          f"its tokens say {want_key!r}")
        for index, _, was_node in seq.swapped:
            if was_node and index >= len(seq.hashes):
                _fail(f"swapped seq {sid}: page {index} was a node but has no hash")


# --------------------------------------------------------------------- stats

def _check_stats(state: ManagerState) -> None:
    s = state.stats()
    n = state.pool.num_pages
    want = dict(
        total_pages=n,
        free_pages=len(state.pool.free),
        cached_pages=len(state.tree.evictable()),   # a blocked page counts as used
        used_pages=sum(1 for r in state.pool.ref if r > 0) + len(state.tree.parked()) - len(state.tree.evictable()),
        num_sequences=len(state.seqs),
        free_seq_ids=len(state.seq_ids.free_ids()),
        cpu_total_pages=state.cpu.num_pages,
        cpu_free_pages=len(state.cpu.free) + len(state.cpu.pending),
        page_size=state.page_size,
        max_seqs=state.seq_ids.max_seqs,
        num_swapped=sum(1 for q in state.seqs.values() if q.state is SeqState.SWAPPED),
        epoch=state.epoch,
        tree_pages=len(state.tree.page_of),
        last_event=state.events.last,
    )
    for name, value in want.items():
        if getattr(s, name) != value:
            _fail(f"stats.{name} = {getattr(s, name)}, state says {value}")
    if s.free_pages + s.cached_pages + s.used_pages != s.total_pages:
        _fail(f"stats: free {s.free_pages} + cached {s.cached_pages} + used {s.used_pages} "
              f"!= total {s.total_pages}")
    if s.prefix_hit_tokens > s.prefix_query_tokens:
        _fail(f"stats: {s.prefix_hit_tokens} hit tokens > {s.prefix_query_tokens} queried")
    if s.cpu_free_pages > s.cpu_total_pages or s.free_seq_ids > s.max_seqs:
        _fail(f"stats: free counts exceed totals: {s}")


def snapshot(state: ManagerState) -> tuple:
    """Everything a failed call must leave untouched."""
    seqs = {
        sid: (s.request_id, list(s.pages), list(s.tokens), s.num_computed, s.state, list(s.swapped),
              s.num_published, s.diverged_at, list(s.hashes), s.cached_tokens)
        for sid, s in state.seqs.items()
    }
    return (state.stats(), seqs, dict(state.by_request), list(state.running), list(state.swapped),
            dict(state.tree.page_of), list(state.tree.parent_of), list(state.tree.children),
            list(state.pool.free), state.tree.parked(),
            list(state.pool.ref), state.seq_ids.free_ids(), list(state.cpu.free), list(state.cpu.pending),
            list(state.pending_seq_ids), state.epoch, state.events.last)


class EventMirror:
    """Replays the event log into a hash -> parent-hash map, the way a router
    would, and checks it against the tree: numbers rise by one, a stored chain
    hangs off a known parent, an evicted page is a leaf, and the replay equals
    the tree after every call."""

    def __init__(self) -> None:
        self.nodes: dict[int, int] = {}
        self.last = 0
        self.evicted = 0
        self.reader: int | None = None

    def sync(self, state: ManagerState) -> list[int]:
        from kvserve.kvcache_service.contract.types import CacheReset, PagesEvicted, PagesStored

        evicted: list[int] = []
        if self.reader is None:   # a reader from the state's first event on
            if state.events.last != self.last:
                _fail(f"events: the mirror started after event {state.events.last}")
            self.reader = state.events.open()
        for ev in state.events.read(self.reader):
            if ev.number != self.last + 1:
                _fail(f"events: expected number {self.last + 1}, got {ev.number}")
            self.last = ev.number
            if isinstance(ev, PagesStored):
                parent = ev.parent_hash
                if parent != ROOT_HASH and parent not in self.nodes:
                    _fail(f"events: pages stored under unknown parent {parent:#x}")
                for h in ev.hashes:
                    if h in self.nodes:
                        _fail(f"events: page {h:#x} stored twice")
                    self.nodes[h] = parent
                    parent = h
            elif isinstance(ev, PagesEvicted):
                for h in ev.hashes:
                    if h not in self.nodes:
                        _fail(f"events: unknown page {h:#x} evicted")
                    del self.nodes[h]
                    if h in self.nodes.values():
                        _fail(f"events: page {h:#x} evicted while it still has children")
                    evicted.append(h)
            elif isinstance(ev, CacheReset):
                self.nodes.clear()
            else:
                _fail(f"events: unknown event {ev!r}")
        if self.last != state.events.last:
            _fail(f"events: replayed up to {self.last}, log is at {state.events.last}")
        tree = state.tree
        actual = {}
        for h, p in tree.page_of.items():
            parent = tree.parent_of[p]
            actual[h] = ROOT_HASH if parent == NO_PARENT else tree.hash_of[parent]
        if actual != self.nodes:
            _fail(f"events: replay holds {len(self.nodes)} pages, tree {len(actual)}; "
                  f"missing {set(actual) - set(self.nodes)}, extra {set(self.nodes) - set(actual)}")
        self.evicted += len(evicted)
        return evicted
