"""Which worker a request goes to. Policy only: it reads the workers' last reports, the index's
matches and the gateway's own routings since those reports, and changes nothing.

A worker with room (serving, fewer sequences running and requests waiting there than its
--max-num-seqs plus --worker-queue-depth, counting the n sequences of each request sent since its
last report, and never fewer than this gateway's own streams' sequences there; fewer waiting there,
those sent since counted as waiting, than its own --max-waiting; pages enough for what it must
compute; no call there failed or refused since that report) and no more than --balance-slack
requests busier than the least busy such worker (so that no cache, however warm, draws
everything to one worker while others idle; what the default, 4, costs and gains against 0 and 2
is in docs/benchmarks.md) costs

    overlap_weight × (prompt tokens it must compute, and those ahead of them) + (its decode load, in tokens)

where the prompt tokens ahead are the prefills it is running or about to run (its report's, less
this gateway's streams' prefills done since, plus its requests not yet taken, never fewer than its
own streams' still to prefill: Worker.prefill_backlog), steps between this request and its first
token that a count of sequences does not show, and the decode load counts the sequences there
(its last report's count, less this gateway's streams that ended there since, plus those it sent
there since, so a burst of misses spreads instead of all landing on the emptiest worker before
its next report, and a finished conversation's worker is not thought busy): a page of compute
for each one its batch runs (decodes share each step), an average request's prompt for each one
queued beyond its batch (it is prefilled first; one this gateway sent and the worker has not
taken yet counts by its own prompt, in the prompt tokens ahead). Among workers within one page's
compute of the cheapest: the longest cached prefix; then a cold worker (empty cache); then the least
recently used; then a hash of the request's first page (or session) and the worker's address,
so that one conversation keeps choosing the same worker among equals while different ones, and
several gateways, spread. No worker with room: the request waits in the gateway's queue.
A session sticks to its last worker while that worker has room.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from itertools import islice

from kvserve.services.gateway.board import LoadBoard, shape_of, why_not
from kvserve.services.gateway.worker import SERVING, Worker


@dataclass(frozen=True)
class Choice:
    worker: Worker
    matched_pages: int
    mark: object = None   # Worker.routed()'s, once the choice is taken


@dataclass(frozen=True)
class Policy:
    page_size: int
    overlap_weight: float = 1.0
    worker_queue_depth: int = 2
    balance_slack: int = 4
    length: int = 0   # the request's prompt and output together: a worker's model must hold it
    salted: bool = False   # it carries a cache_salt: only a worker that keeps it may take it
    output: str = "max_tokens"   # what asked for the output's length: min_tokens holds even with sinks


def has_room(w: Worker, policy: Policy, pages_needed: int, prompt_tokens: int = 0, active: int | None = None) -> bool:
    """Room for a request now: serving, not held off (a call there failed or was refused since
    its last report), its queue not full (--worker-queue-depth past its batch, and its own
    --max-waiting), pages enough, and nothing that would always refuse it there (board.why_not:
    a model length too short, a fleet may mix --max-model-len; a cache_salt it would ignore).
    `active`: w.active, when the caller has it (a sum over its routings)."""
    ld, info = w.load, w.info
    if w.state != SERVING or w.held_off:
        return False
    if info is not None and why_not(shape_of(info), prompt_tokens, policy.length, policy.output, policy.salted):
        return False
    batch = info.max_num_seqs if info is not None and info.max_num_seqs else 1
    # its own bound counts every request it has not yet admitted (those sent since its report too)
    queue_full = info is not None and info.max_waiting and ld.waiting + w.pending >= info.max_waiting
    if info is not None and info.page_size and info.page_size != policy.page_size:
        # the request is hashed in the fleet's smallest page size: no match is known here
        pages_needed = -(-prompt_tokens // info.page_size)
    if info is not None and info.sliding_window:   # a sequence there holds at most two windows (and sinks)
        pages_needed = min(pages_needed, -(-(2 * info.sliding_window + info.attention_sink) // info.page_size))
    active = w.active if active is None else active
    return not queue_full and active < batch + policy.worker_queue_depth and ld.free_pages + ld.cached_pages >= pages_needed


def choose(workers: LoadBoard | Iterable[Worker], matches: Mapping[str, int], prompt_tokens: int, policy: Policy,
           key: bytes, sticky: Worker | None = None, mean_request_tokens: float = 0.0,
           avoid: Worker | None = None, depths: Depths | None = None, widen: bool = True) -> Choice | None:
    """The worker for a request of `prompt_tokens` whose leading pages `matches` says workers
    hold (the index's deepest holders: PrefixIndex.holders); `depths` tells how many any other
    worker weighed holds (without it, those not in `matches` hold none). None when no worker
    has room. `key` names the request (its first page, or its session) for the last tie-break;
    `avoid` (the worker it just failed on) is chosen only when no other worker has room.
    `widen`: when none of the shortlist has room, look further down the board (further())."""
    ps = policy.page_size
    total_pages = -(-prompt_tokens // ps)
    board = _as_board(workers)
    weighed = shortlist(board, matches, sticky, ps, avoid)
    matches = _with_depths(matches, weighed, depths)
    active = {w: w.active for w in weighed}   # (each a sum over its routings: once per choice)
    room = [w for w in weighed
            if has_room(w, policy, total_pages - matches.get(w.address, 0), prompt_tokens, active[w])]
    if not room and widen:   # the least busy few cannot take it (too short a model, no pages left): others may
        room = further(board, weighed, policy, total_pages, prompt_tokens, avoid)
        matches = _with_depths(matches, room, depths)
        active = {w: w.active for w in room}
    if not room:
        if avoid is not None:   # what it holds there, if the deepest holders left it out
            matches = _with_depths(matches, [avoid], depths)
        return _avoided(board, avoid, policy, total_pages - matches.get(avoid.address, 0) if avoid else 0,
                        prompt_tokens, matches)
    if sticky is not None and sticky in room:   # before the balance: a session leaves only a full worker
        return Choice(sticky, matches.get(sticky.address, 0))
    least = min(active[w] for w in room)
    room = [w for w in room if active[w] <= least + policy.balance_slack]

    def cost(w: Worker) -> float:
        uncached = max(0, prompt_tokens - matches.get(w.address, 0) * ps)
        batch = w.info.max_num_seqs if w.info is not None and w.info.max_num_seqs else 1
        # queued there: each must be prefilled before this one (those not yet taken are in the
        # prefill ahead by their own prompts, not here by an average one)
        ahead = max(0, active[w] - batch - w.untaken) if active[w] > batch else 0
        load = ahead * mean_request_tokens + min(active[w], batch) * ps
        return policy.overlap_weight * (uncached + w.prefill_backlog) + load

    costs = {w.address: cost(w) for w in room}
    best = min(costs.values())
    near = [w for w in room if costs[w.address] <= best + policy.overlap_weight * ps]

    def preference(w: Worker) -> tuple:
        cold = w.load.tree_pages == 0
        return (-matches.get(w.address, 0), not cold, w.last_routed, _rendezvous(key, w.address))

    pick = min(near, key=preference)
    return Choice(pick, matches.get(pick.address, 0))


SHORTLIST_LEAST_BUSY = 8
# A walk further down the board that found no room is not walked again sooner: the queue's head
# asks at each load report, and a fleet full by its pages would be walked whole each time.
WIDEN_EVERY_S = 0.1
SHORTLIST_HOLDERS = 16   # the deepest holders of a prompt's pages weighed (PrefixIndex.holders' `most`)

# How many leading pages of the request each named worker holds: the index's answer for workers
# weighed that its deepest holders left out.
Depths = Callable[[list[str]], Mapping[str, int]]


def _with_depths(matches: Mapping[str, int], workers: Iterable[Worker], depths: Depths | None) -> Mapping[str, int]:
    unknown = [w.address for w in workers if w.address not in matches]
    if depths is None or not unknown:
        return matches
    return {**matches, **{a: n for a, n in depths(unknown).items() if n}}


def further(board: LoadBoard, weighed: list[Worker], policy: Policy, pages: int, prompt_tokens: int,
            avoid: Worker | None = None) -> list[Worker]:
    """Workers with room past the shortlist, the least busy first, up to SHORTLIST_LEAST_BUSY of
    them: when every one of the least busy few is one that cannot take this request (its model
    too short, its pages taken by a long context), the queue's head waited for ever while idle
    workers elsewhere could. Their cached pages are not counted here (conservative: room for the
    whole prompt), and the scan stops at the first workers too busy for any batch, so a fleet
    full by its batches costs no walk over it; one full by its pages does (Fleet.choose asks for
    that walk at most every WIDEN_EVERY_S while it finds nothing)."""
    seen, out = set(weighed), []
    for w in board.least_busy(avoid, below=board.largest_batch + policy.worker_queue_depth):
        if w not in seen and has_room(w, policy, pages, prompt_tokens):
            out.append(w)
            if len(out) == SHORTLIST_LEAST_BUSY:
                break
    return out


def shortlist(board: LoadBoard, matches: Mapping[str, int], sticky: Worker | None, page_size: int,
              avoid: Worker | None = None) -> list[Worker]:
    """The workers worth weighing: those `matches` names (the deepest holders of the prompt's
    pages), the session's, and the least busy few (every one, in a fleet of up to twice as
    many). Read off the board, so a large fleet's choice costs what a small one's does."""
    few = SHORTLIST_LEAST_BUSY if len(board) > 2 * SHORTLIST_LEAST_BUSY else len(board)
    picked = dict.fromkeys(islice(board.least_busy(avoid), few))
    for address in matches:
        w = board.get(address)
        if w is not None and w is not avoid and w.info.page_size == page_size:
            picked[w] = None
    if sticky is not None and sticky in board and sticky is not avoid:
        picked[sticky] = None
    return list(picked)


def _avoided(board: LoadBoard, avoid: Worker | None, policy: Policy, pages_needed: int, prompt_tokens: int,
             matches: Mapping[str, int]) -> Choice | None:
    """The worker a moved request left, when no other has room and it has (it came back, or its
    failure was the request's alone): waiting for another would hold the queue behind it."""
    if avoid is None or avoid not in board or not has_room(avoid, policy, pages_needed, prompt_tokens):
        return None
    return Choice(avoid, matches.get(avoid.address, 0))


def choose_blind(workers: LoadBoard | Iterable[Worker], prompt_tokens: int, policy: Policy, how: str, turn: int,
                 rng, avoid: Worker | None = None) -> Choice | None:
    """The peers cache-aware routing is measured against: round-robin (the `turn`-th worker with
    room, in address order) or random among workers with room; neither looks at any cache."""
    board = _as_board(workers)
    pages = -(-prompt_tokens // policy.page_size)
    room = sorted((w for w in board.least_busy(avoid) if has_room(w, policy, pages, prompt_tokens)),
                  key=lambda w: w.address)
    if not room:
        return _avoided(board, avoid, policy, pages, prompt_tokens, {})
    return Choice(room[turn % len(room)] if how == "round-robin" else rng.choice(room), 0)


def _as_board(workers: LoadBoard | Iterable[Worker]) -> LoadBoard:
    """The fleet's board, or one made of `workers` as they are now (tests, one-off choices)."""
    return workers if isinstance(workers, LoadBoard) else LoadBoard(workers)


def _rendezvous(key: bytes, address: str) -> bytes:
    return hashlib.blake2b(key + address.encode(), digest_size=8).digest()
