"""The workers behind the gateway: adding and removing them, following each (follow.py), the
prefix index they feed, and the choice of a worker for a request (router.py) with the facts
that choice needs."""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections import Counter, OrderedDict
from itertools import islice

from kvserve.kvcache_service.contract.hashing import page_hashes, request_extra_key
from kvserve.services.gateway.board import LoadBoard
from kvserve.services.gateway.fleet_model import FleetModel
from kvserve.services.gateway.follow import Follower
from kvserve.services.gateway.index import PrefixIndex
from kvserve.services.gateway.peer_addresses import without_addresses
from kvserve.services.gateway.router import SHORTLIST_HOLDERS, WIDEN_EVERY_S, Choice, Policy, choose, choose_blind
from kvserve.services.gateway.waiting import WaitQueue
from kvserve.services.gateway.worker import DOWN, SERVING, Worker
from kvserve.services.plumbing.tls import ClientTLS

log = logging.getLogger(__name__)

MAX_SESSIONS = 100_000


def session_key(tenant: str, session_id: str) -> str:
    """A session as the gateway remembers it: each tenant's are its own (OpenAI's `user` becomes
    a session id, and one tenant's "alice" must neither go to another's worker nor move it).
    Tenants hold no NUL, so no two (tenant, session) pairs meet."""
    return f"{tenant}\x00{session_id}" if session_id else ""


class Fleet:
    def __init__(self, cache_salt: str, overlap_weight: float, worker_queue_depth: int, poll_s: float,
                 queue: WaitQueue, routing: str = "cache", balance_slack: int = 4,
                 worker_tls: ClientTLS | None = None, tenants: bool = False, model: FleetModel | None = None,
                 lanes: bool = True) -> None:
        self.worker_tls = worker_tls
        self.lanes = lanes   # Generate over a worker's lane where it offers one (--lane auto)
        self.model = model   # what every worker must serve (None: not compared)
        self.tenants = tenants   # requests carry tenants (--api-keys): a worker must keep them apart
        self.balance_slack = balance_slack
        self.cache_salt = cache_salt
        self.routing = routing
        self._turn = 0
        self._rng = random.Random()
        self._fruitless_widen_at = -WIDEN_EVERY_S   # when a walk further down the board last found no room
        self.overlap_weight = overlap_weight
        self.worker_queue_depth = worker_queue_depth
        self.poll_s = poll_s
        self.queue = queue
        self.index = PrefixIndex()
        self.workers: dict[str, Worker] = {}
        self.board = LoadBoard()   # the serving ones, least busy first
        self._followers: dict[str, Follower] = {}
        self._closing: set[asyncio.Task] = set()   # channels of removed workers, closed once idle
        self._sessions: OrderedDict[str, str] = OrderedDict()   # session id -> worker address
        self._prompt_tokens_seen = 0
        self.migrations = 0   # streams moved off a failed worker
        self.generated_tokens = 0   # streamed to this gateway's clients
        self.prompt_tokens = 0      # of its clients' requests, once each, however often a request moved
        self.cached_tokens = 0      # of those, found in the first worker's cache (what the client was told)
        self.ended = {"finished": 0, "aborted": 0, "failed": 0}   # this gateway's streams, by how they ended
        self.refused: Counter[str] = Counter()   # calls refused before they ran, by gRPC status code name
        self._requests_seen = 0

    # ------------------------------------------------------------ membership

    def add(self, address: str) -> None:
        if address in self.workers:
            return
        worker = Worker.connect(address, self.worker_tls, self.lanes)
        self.workers[address] = worker
        self.board.add(worker)
        follower = Follower(worker, self.index, self.cache_salt, self.poll_s, self.queue.wake, self._moved_off,
                            self.tenants, self.model)
        self._followers[address] = follower
        follower.start()
        log.info("worker %s added", address)

    async def remove(self, address: str, let_streams_finish: bool = True) -> None:
        """No new requests go there; streams running on it go on until they end (its load still
        watched, so that they move if it fails; its channel closed after them, in the
        background), unless the gateway itself is closing."""
        follower = self._followers.pop(address, None)
        worker = self.workers.pop(address, None)
        if worker is not None:
            self.board.remove(worker)   # before any await: from now on nothing is routed there
        if follower is not None:
            await follower.stop_events()
            log.info("worker %s removed", address)
        if worker is None:
            return
        if worker.relays and let_streams_finish:
            task = asyncio.create_task(self._close_when_idle(worker, follower), name=f"close {address}")
            self._closing.add(task)
            task.add_done_callback(self._closing.discard)
        else:
            await self._close(worker, follower)

    async def _close_when_idle(self, worker: Worker, follower: Follower | None) -> None:
        try:
            while worker.relays:
                await asyncio.sleep(0.5)
        finally:
            await self._close(worker, follower)

    @staticmethod
    async def _close(worker: Worker, follower: Follower | None) -> None:
        worker.closed = True   # (before any await: a relay about to send there looks first)
        if follower is not None:
            await follower.stop()
        worker.close_lane()
        await worker.channel.close()

    async def close(self) -> None:
        for address in list(self.workers):
            await self.remove(address, let_streams_finish=False)
        for task in list(self._closing):
            task.cancel()
        await asyncio.gather(*self._closing, return_exceptions=True)

    def why_none_serving(self, addresses: bool = True, most: int = 3) -> str:
        """Why the workers are not serving, as "; ..." clauses ("" when none says): a client whose
        request waited in vain learns, say, that every worker serves another model. With
        `addresses`, each of the first few workers' own words (for the stats); without, each
        reason once with how many workers give it, a down worker only as "down" (its error
        names its address, which is the log's, not a client's)."""
        if addresses:
            said = [f"{w.address}: {w.not_serving}" for w in self.workers.values() if w.not_serving]
        else:
            reasons = Counter("down" if w.state == DOWN else w.not_serving for w in self.workers.values()
                              if w.not_serving)
            said = [f"{k} worker{'s' if k > 1 else ''}: {without_addresses(why)}" for why, k in reasons.items()]
        more = f"; and {len(said) - most} more" if len(said) > most else ""
        return "".join(f"; {s}" for s in said[:most]) + more

    def _moved_off(self, worker: Worker) -> None:
        for relay in list(worker.relays):
            relay.move_off(worker)

    # ------------------------------------------------------------ routing

    @property
    def page_size(self) -> int | None:
        return self.board.page_size

    def never_fits(self, prompt_tokens: int, length: int = 0, output: str = "max_tokens",
                   salted: bool = False) -> str | None:
        """Why no serving worker could ever take a prompt this long, with `length` tokens in all
        (`output` asked for those past the prompt; `salted`: with a cache_salt); None when one could."""
        return self.board.never_fits(prompt_tokens, length, output, salted)

    def fits_one_away(self, prompt_tokens: int, length: int = 0, output: str = "max_tokens",
                      salted: bool = False) -> bool:
        """A worker not serving now could take what no serving one can, once it is back."""
        return self.board.fits_one_away(prompt_tokens, length, output, salted)

    def hashes(self, ids: list[int], tenant: str = "", page_size: int | None = None,
               cache_salt: str = "") -> list[int]:
        """The pages' hashes as the worker computes them: the same salt, the same tenant, the
        request's own cache_salt (pages of the board's page size unless told)."""
        ps = page_size or self.page_size
        key = request_extra_key(self.cache_salt, tenant, cache_salt)
        return page_hashes(ids, ps, extra_key=key) if ps and ids else []

    def choose(self, ids: list[int], hashes: list[int], session_id: str, avoid: Worker | None = None,
               length: int = 0, sequences: int = 1, salted: bool = False,
               output: str = "max_tokens", continued: int = 0) -> Choice | None:
        """The worker for a request of prompt `ids`, `length` tokens in all with its output, and
        `sequences` (its n) to run; `continued`: tokens of its continuation, computed there too.
        `session_id`: its tenant's session (session_key), or empty."""
        ps = self.page_size
        if ps is None:
            return None
        def matchable(address: str) -> bool:   # (a worker of another model may hash alike: not a session's home)
            w = self.workers.get(address)
            return w is not None and w.hashes_match and w.events_live and w.state == SERVING

        # twice as many named as weighed: holders it would not route to (draining, another page
        # size's) must not take the places of those it would
        named = self.index.holders(hashes, most=2 * SHORTLIST_HOLDERS)
        matches = dict(islice(((a, n) for a, n in named.items() if matchable(a)), SHORTLIST_HOLDERS))

        def depths(addresses: list[str]) -> dict[str, int]:   # workers weighed beside the deepest holders
            return self.index.matches(hashes, [a for a in addresses if matchable(a)]) if hashes else {}
        if session_id:
            key = session_id.encode()
        else:
            key = hashes[0].to_bytes(8, "little") if hashes else repr(ids[:16]).encode()
        sticky = self.workers.get(self._sessions.get(session_id, "")) if session_id else None
        if session_id and sticky is None and matches:
            # A session this replica has not routed (another gateway did, or it is new): the
            # worker holding more of its prompt than any other is its worker, as every replica
            # reads the same index (each stuck it to a worker of its own, and the turns went back
            # and forth, each losing the last's cache). Workers holding as much are no sign of its
            # home: a new session's prompt shares a system prompt every warm worker holds (taking
            # the highest address, every new session went to one worker while the others idled).
            held = sorted(matches.values(), reverse=True)
            if len(held) == 1 or held[0] > held[1]:
                sticky = self.workers.get(max(matches, key=matches.__getitem__))
        mean = self._prompt_tokens_seen / self._requests_seen if self._requests_seen else 0.0
        policy = Policy(ps, self.overlap_weight, self.worker_queue_depth, self.balance_slack, length, salted, output)
        if self.routing == "cache":
            now = time.monotonic()
            widen = now - self._fruitless_widen_at >= WIDEN_EVERY_S
            choice = choose(self.board, matches, len(ids), policy, key, sticky, mean, avoid, depths, widen)
            if choice is None and widen:
                self._fruitless_widen_at = now
        else:
            choice = choose_blind(self.board, len(ids), policy, self.routing, self._turn, self._rng, avoid)
            self._turn += choice is not None
        if choice is not None and self.routing != "cache":   # what it finds there, for the stats
            address = choice.worker.address
            choice = Choice(choice.worker, matches.get(address) or depths([address]).get(address, 0))
        if choice is not None:
            w = choice.worker
            prefill = max(0, len(ids) - choice.matched_pages * ps) + continued
            choice = Choice(w, choice.matched_pages, w.routed(sequences, prefill))
            self._prompt_tokens_seen += len(ids)
            self._requests_seen += 1
            if session_id:
                self._sessions[session_id] = w.address
                self._sessions.move_to_end(session_id)
                if len(self._sessions) > MAX_SESSIONS:
                    self._sessions.popitem(last=False)
        return choice

    def serving(self) -> list[Worker]:
        """The workers on the board: serving, their model known (a report comes only after it)."""
        return list(self.board)
