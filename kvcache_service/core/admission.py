"""Admission: a new sequence, its full prompt pages matched against the prefix tree.

An admission never hits the page holding the last prompt token: at least one token is
always computed, so the model produces logits for it. One that skips prefix hits (its prompt's
logprobs need the logits of every position) matches nothing and computes every token.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvserve.kvcache_service.contract.hashing import token_bytes
from kvserve.kvcache_service.contract.types import Admit, NeedResult
from kvserve.kvcache_service.core.sequence import Sequence
from kvserve.kvcache_service.core.state import Cost, ManagerState


@dataclass(slots=True)
class AdmitMatch:
    """What the tree holds of a prompt, and what admitting it costs."""
    hashes: list[int]  # of the hits
    hits: list[int]    # cached pages, in order
    cached: int        # tokens they hold
    todo: int          # tokens given slots beyond them
    cost: Cost


def match(state: ManagerState, need: Admit) -> AdmitMatch:
    """Matches the prompt against the tree (read-only)."""
    tokens, ps = need.token_ids, state.page_size
    limit = 0 if need.skip_prefix_hits else (len(tokens) - 1) // ps  # never the page holding the last token
    tree, ref = state.tree, state.pool.ref
    hits = tree.match_bytes(token_bytes(tokens[: limit * ps]), ps * 4, need.extra_key) if limit > 0 else []
    hash_of = tree.hash_of
    hashes = [hash_of[page] for page in hits]  # known: the hits are nodes
    # hits that stop being evictable: a blocked one (after a slide) was not counted as available
    parked = 0
    for page in hits:
        if not ref[page] and tree.is_evictable(page):
            parked += 1
    cached = len(hits) * ps
    todo = len(tokens) - cached
    if need.max_tokens is not None:
        todo = min(todo, need.max_tokens)
    return AdmitMatch(hashes, hits, cached, todo, Cost(-(-(cached + todo) // ps) - len(hits), parked, 1))


def admit(state: ManagerState, need: Admit, found: AdmitMatch) -> NeedResult:
    """Admits a checked need whose match fits."""
    seq_id = state.seq_ids.acquire()
    seq = Sequence(seq_id, need.request_id, need.extra_key, list(need.token_ids))
    ref, unpark = state.pool.ref, state.tree.unpark
    for page in found.hits:  # state.hold, inlined
        if not ref[page]:
            unpark(page)
        ref[page] += 1
    seq.pages = found.hits + state.take(found.cost.pages)
    seq.hashes = found.hashes
    seq.num_computed = seq.cached_tokens = found.cached
    seq.num_published = len(found.hits)
    state.add(seq)
    counters = state.counters
    counters.prefix_query_tokens += len(seq.tokens)
    counters.prefix_hit_tokens += found.cached
    return NeedResult(True, seq_id, list(seq.pages), True, found.cached, found.todo)
