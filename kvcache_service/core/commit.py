"""Commit: tokens computed; a page enters the prefix tree once it is full and computed.

A page that is allocated but not yet computed is never served as a hit. A sequence whose page
duplicates a node another sequence stored first keeps its own copy private, and stores
nothing after it (`Sequence.diverged_at`): its later pages hash a prefix the tree reaches
through the other sequence's page.
"""

from __future__ import annotations

from kvserve.kvcache_service.contract.hashing import ROOT_HASH, hash_pages, token_bytes
from kvserve.kvcache_service.contract.types import Commit
from kvserve.kvcache_service.core.sequence import Sequence
from kvserve.kvcache_service.core.state import ManagerState


def commit(state: ManagerState, c: Commit) -> int:
    """Records computed tokens; full computed pages enter the tree. Returns pages stored."""
    seq = state.seqs[c.seq_id]
    tokens = seq.tokens
    if c.token_ids:
        tokens.extend(c.token_ids)
    seq.num_computed = c.num_computed
    ps = state.page_size
    full = min(c.num_computed, len(tokens)) // ps
    first = seq.num_published
    if full <= first:
        return 0
    hashes = seq.hashes
    data = token_bytes(tokens[first * ps : full * ps])  # pages first .. full-1, packed once
    if len(hashes) < full:
        start = len(hashes)  # >= first: published pages always have their hashes
        hashes += hash_pages(data, ps, seq.extra_key, hashes[start - 1] if start else ROOT_HASH, start - first)
    stored = 0
    chain: list[int] = []
    chain_parent = ROOT_HASH
    events = state.events
    tree, pages, get, key, width = state.tree, seq.pages, state.tree.page_of.get, seq.extra_key, ps * 4
    for i in range(first, full if seq.diverged_at is None and not seq.slid else first):
        h = hashes[i]
        existing = get(h)
        if existing is None:
            parent = hashes[i - 1] if i else ROOT_HASH
            if not chain:
                chain_parent = parent
            off = (i - first) * width
            tree.insert(h, parent, pages[i], data[off : off + width], key)
            chain.append(h)
            continue
        if chain:
            events.stored(chain_parent, chain)
            stored += len(chain)
            chain = []
        if existing != pages[i]:
            seq.diverged_at = i  # another sequence stored this page first; ours stays private
            break
    if chain:
        events.stored(chain_parent, chain)
        stored += len(chain)
    seq.num_published = full
    return stored


def publish(state: ManagerState, seq: Sequence, indices: list[int]) -> None:
    """Puts pages that were tree nodes before a swap-out back into the tree,
    head first so parents go in before children. A page whose hash another
    sequence stored meanwhile stays private, and so do the ones after it."""
    if seq.slid:   # it stores nothing in the tree any more (release.slide)
        return
    for index in indices:
        if seq.diverged_at is not None and index >= seq.diverged_at:
            return
        h, page = seq.hashes[index], seq.pages[index]
        existing = state.tree.get(h)
        if existing is None:
            parent = seq.parent_hash(index)
            ps = state.page_size
            state.tree.insert(h, parent, page, token_bytes(seq.tokens[index * ps : (index + 1) * ps]),
                              seq.extra_key)
            state.events.stored(parent, [h])
        elif existing != page:
            seq.diverged_at = index
            return
