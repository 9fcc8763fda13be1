"""The gateway's routing and index at fleet scale, simulated: 64-256 workers, 10,000 conversations.

    .venv/bin/python bench/gateway_sim.py                      # 64, 128 and 256 workers
    .venv/bin/python bench/gateway_sim.py --workers 64 --conversations 2000

What is real: each worker's KV-cache manager (the core, `KVCacheManager`: its prefix tree, its
evictions), its events in the wire format (converted to protobuf, read by the gateway's own
`EventCursor`), the gateway's `PrefixIndex`, `Worker` load bookkeeping and `router.choose`.
What is simulated: time. A worker runs up to --max-num-seqs requests at once; their prefills
one after another (uncached prompt tokens × --prefill-us each: a long prompt's step delays every
first token behind it), their decodes side by side (reply tokens × --decode-us), and it reports
its load (with the prompt tokens of the prefills under way or queued, which the router weighs)
every --report-ms (default 50: real workers push a changed load at most every
--poll-interval, 50 ms, so this is the slowest a report comes), and the gateway's index receives
its events at those reports too (a pessimistic lag: over gRPC they arrive within milliseconds);
conversations arrive at --rate per simulated second, each a shared
system prompt (one of --systems) and --turns turns of user tokens and replies.

Printed per fleet size: the hit rate (cached / prompt tokens, as the managers counted it)
against an oracle that knows every cache at the moment of each request (fed every event at
once) and counts the longest prefix any worker holds (ignoring load: an upper bound on hits),
and against random routing on the same trace; time to first token (p50 / p90, simulated
time, the same for random in brackets); the routing decision time per request (p50, p99: index lookups and
the choice, measured with perf_counter); the index's memory (its own dicts, lists, sets and the
ints in them, each counted once, by sys.getsizeof: tracemalloc, used before, slowed every
allocation and so every decision timed beside it ~3.5x) and its pages; the load spread (requests per worker: min, max, coefficient of
variation). Workers' caches are small (--pages) so that evictions happen.
"""

from __future__ import annotations

import argparse
import heapq
import itertools
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from kvserve.inference.v1 import inference_pb2 as pb  # noqa: E402
from kvserve.kvcache_service.contract.convert import event_to_pb  # noqa: E402
from kvserve.kvcache_service.contract.hashing import page_hashes  # noqa: E402
from kvserve.kvcache_service.contract.types import Admit, Commit, StepRequest  # noqa: E402
from kvserve.kvcache_service.core import ManagerConfig  # noqa: E402
from kvserve.kvcache_service.core.manager import KVCacheManager  # noqa: E402
from kvserve.services.gateway.board import LoadBoard  # noqa: E402
from kvserve.services.gateway.follow import EventCursor  # noqa: E402
from kvserve.services.gateway.index import PrefixIndex  # noqa: E402
from kvserve.services.gateway.router import SHORTLIST_HOLDERS, Choice, Policy, choose  # noqa: E402
from kvserve.services.gateway.worker import SERVING, Load, Worker  # noqa: E402

PAGE = 16


class SimWorker:
    def __init__(self, i: int, pages: int, max_num_seqs: int, index: PrefixIndex, oracle: PrefixIndex) -> None:
        self.address = f"10.0.{i // 256}.{i % 256}:50051"
        self.manager = KVCacheManager(ManagerConfig(num_pages=pages, page_size=PAGE, max_seqs=4 * max_num_seqs))
        self.manager.register(1, PAGE, pages)
        self.reader = self.manager.events.open()
        # The gateway's view gets the events at each report; the oracle's at once.
        self.cursor, self.exact = EventCursor(index, self.address), EventCursor(oracle, self.address)
        self.pending_events: list = []
        snap = event_to_pb(self.manager.snapshot())
        self.cursor.apply(snap)
        self.exact.apply(snap)
        self.requests = 0
        self.view = Worker(self.address, channel=None, state=SERVING,
                           info=pb.ModelInfo(page_size=PAGE, max_num_seqs=max_num_seqs))
        self.view.load = Load(free_pages=pages, tree_pages=0)
        self.busy_until: list[float] = []   # completion times of its requests in flight
        self.prefilling: list[tuple[float, int]] = []   # (when its prefill ends, its tokens) of those
        self.prefill_free_at = 0.0   # when the prefills it has now are done
        self.served = 0

    def run(self, ids: list[int], reply: list[int], now: float, prefill_us: float,
            decode_us: float) -> tuple[int, float, float]:
        """Admits, computes and releases one request in the manager; (cached tokens, when its first
        token comes, when it ends)."""
        m = self.manager
        self.requests += 1
        plan = m.step(StepRequest(epoch=1, needs=[Admit(f"{self.address}/{self.requests}", ids)]))
        result = plan.results[0]
        if not result.granted:   # no room for the prompt: count it as computed in full, elsewhere
            return 0, now + len(ids) * prefill_us / 1e6, now + len(ids) * prefill_us / 1e6
        seq = result.seq_id
        m.step(StepRequest(epoch=1, commits=[Commit(seq, len(ids), ())]))
        m.step(StepRequest(epoch=1, releases=[seq]))
        self.served += 1
        start = max(now, min(self.busy_until) if len(self.busy_until) >= self.view.info.max_num_seqs else now)
        computed = len(ids) - result.cached_tokens
        first = max(start, self.prefill_free_at) + computed * prefill_us / 1e6
        self.prefill_free_at = first
        end = first + len(reply) * decode_us / 1e6
        self.busy_until.append(end)
        self.prefilling.append((first, computed))
        return result.cached_tokens, first, end

    def take_events(self) -> None:
        for e in self.manager.events.read(self.reader):
            msg = event_to_pb(e)
            self.exact.apply(msg)
            self.pending_events.append(msg)

    def report(self, now: float) -> None:
        for msg in self.pending_events:
            self.cursor.apply(msg)
        self.pending_events.clear()
        self.busy_until = [t for t in self.busy_until if t > now]
        self.prefilling = [p for p in self.prefilling if p[0] > now]
        s = self.manager.stats()
        n = len(self.busy_until)
        cap = self.view.info.max_num_seqs
        self.view.loaded(Load(running=min(n, cap), waiting=max(0, n - cap), free_pages=s.free_pages,
                              cached_pages=s.cached_pages, used_pages=s.used_pages, tree_pages=s.tree_pages,
                              asked_at=now, prefill_tokens=sum(tokens for _, tokens in self.prefilling)))
        self.view.routed_at.clear()   # a simulated report counts every request routed before it
        self.view.prefills_done.clear()   # and no prefill done before it
        self.view.changed()


def object_bytes(root) -> int:
    """What `root`'s attributes take in memory: every dict, list, set and int reachable from
    them, each object counted once."""
    seen, total, stack = set(), 0, [vars(root)]
    while stack:
        obj = stack.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        total += sys.getsizeof(obj)
        if isinstance(obj, dict):
            stack.extend(obj.keys())
            stack.extend(obj.values())
        elif isinstance(obj, (list, set, tuple)):
            stack.extend(obj)
    return total


def trace(args, rng: random.Random) -> list[tuple[float, int, int]]:
    """(arrival time, conversation, turn), conversations arriving at --rate, turns --think-s apart."""
    out = []
    t = 0.0
    for c in range(args.conversations):
        t += rng.expovariate(args.rate)
        for turn in range(args.turns):
            out.append((t + turn * args.think_s, c, turn))
    out.sort()
    return out


def simulate(n: int, args, routing: str) -> dict:
    rng, route_rng = random.Random(args.seed), random.Random(args.seed + 1)
    vocab = 32000
    systems = [[rng.randrange(3, vocab) for _ in range(args.system)] for _ in range(args.systems)]
    conv_system = [rng.randrange(args.systems) for _ in range(args.conversations)]
    users = {}
    history: dict[int, list[int]] = {}
    index, oracle = PrefixIndex(), PrefixIndex()
    workers = [SimWorker(i, args.pages, args.max_num_seqs, index, oracle) for i in range(n)]
    board = LoadBoard()   # the gateway's: each worker keeps its place current
    for w in workers:
        board.add(w.view)
    by_address = {w.address: w for w in workers}
    policy = Policy(PAGE, 1.0, worker_queue_depth=2, balance_slack=args.balance_slack)
    decisions, prompt_total, cached_total, oracle_total, queued = [], 0, 0, 0, 0
    ttfts: list[float] = []
    # the gateway's own streams' prefill_done, as each comes: (when, order, worker, its mark)
    prefills: list[tuple[float, int, Worker, object]] = []
    order = itertools.count()
    next_report = 0.0
    mean = 0.0
    seen = 0
    for now, c, turn in trace(args, rng):
        while prefills and prefills[0][0] <= now:
            _, _, view, mark = heapq.heappop(prefills)
            view.prefilled(mark)
        if now >= next_report:
            for w in workers:
                w.report(now)
            next_report = now + args.report_ms / 1e3
        if turn == 0:
            history[c] = list(systems[conv_system[c]])
        users[c] = [rng.randrange(3, vocab) for _ in range(rng.randrange(24, 49))]
        ids = history[c] + users[c]
        reply = [rng.randrange(3, vocab) for _ in range(args.reply)]
        hashes = page_hashes(ids, PAGE)
        # the oracle: the longest prefix any worker holds right now (never the last prompt token's page)
        best = max(oracle.holders(hashes).values(), default=0)
        oracle_total += min(best * PAGE, (len(ids) - 1) // PAGE * PAGE)
        t0 = time.perf_counter()
        if routing == "cache":
            hashes = page_hashes(ids, PAGE)   # the gateway hashes each request itself: timed
            if args.all_holders:   # every holder weighed, as before the index named its deepest alone
                matches, depths = index.holders(hashes), None
            else:   # as the gateway's Fleet.choose asks
                matches = index.holders(hashes, most=SHORTLIST_HOLDERS)
                depths = lambda addresses, hashes=hashes: index.matches(hashes, addresses)   # noqa: E731
            choice = choose(board, matches, len(ids), policy, hashes[0].to_bytes(8, "little"),
                            mean_request_tokens=mean, depths=depths)
        else:
            choice = None
        decisions.append(time.perf_counter() - t0)
        if routing == "cache" and choice is None:   # no room anywhere: the queue would hand it to the
            queued += 1                              # first worker to free room, the least busy one
            choice = Choice(next(board.least_busy()), 0)
        w = by_address[choice.worker.address] if choice is not None else route_rng.choice(workers)
        mark = w.view.routed(prefill=len(ids) - (choice.matched_pages if choice is not None else 0) * PAGE)
        mark.take()   # (at once: the simulated worker has it)
        cached, first, _ = w.run(ids, reply, now, args.prefill_us, args.decode_us)
        heapq.heappush(prefills, (first, next(order), w.view, mark))
        ttfts.append(first - now)
        w.take_events()
        seen += 1
        mean += (len(ids) - mean) / seen
        prompt_total += len(ids)
        cached_total += cached
        history[c] = ids + reply
    memory = object_bytes(index)
    served = [w.served for w in workers]
    decisions.sort()
    ttfts.sort()
    return dict(ttft_p50=ttfts[len(ttfts) // 2], ttft_p90=ttfts[int(0.9 * (len(ttfts) - 1))],
                hit=cached_total / prompt_total, queued=queued / len(decisions), oracle=oracle_total / prompt_total,
                p50_us=decisions[len(decisions) // 2] * 1e6, p99_us=decisions[int(0.99 * (len(decisions) - 1))] * 1e6,
                memory_mib=memory / 2**20, index_pages=len(index),
                spread=(min(served), max(served), statistics.pstdev(served) / statistics.mean(served)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", type=int, nargs="+", default=[64, 128, 256])
    ap.add_argument("--conversations", type=int, default=10_000)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--systems", type=int, default=32, help="distinct system prompts")
    ap.add_argument("--system", type=int, default=512, help="system prompt tokens")
    ap.add_argument("--reply", type=int, default=64)
    ap.add_argument("--rate", type=float, default=200.0, help="conversations starting per simulated second")
    ap.add_argument("--think-s", type=float, default=2.0, help="simulated seconds between a conversation's turns")
    ap.add_argument("--pages", type=int, default=1024, help="each worker's KV pages (16 tokens each)")
    ap.add_argument("--max-num-seqs", type=int, default=16)
    ap.add_argument("--prefill-us", type=float, default=100.0)
    ap.add_argument("--decode-us", type=float, default=20_000.0)
    ap.add_argument("--report-ms", type=float, default=50.0,
                    help="simulated milliseconds between load reports (100: the gateway's old polling)")
    ap.add_argument("--balance-slack", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--all-holders", action="store_true",
                    help="weigh every worker holding the prompt's first page (as before the index named the "
                         "deepest %d alone): to compare" % SHORTLIST_HOLDERS)
    ap.add_argument("--ignore-prefill-ahead", action="store_true",
                    help="the router blind to the prefill ahead at each worker (as before it weighed it): "
                         "to compare")
    args = ap.parse_args()
    print(f"{args.conversations:,} conversations x {args.turns} turns, {args.systems} system prompts of "
          f"{args.system} tokens, {args.pages} pages of {PAGE} per worker")
    print(f"{'workers':>8} {'hit':>7} {'oracle':>7} {'random':>7} {'queued':>7} {'TTFT p50/p90 (random)':>28} "
          f"{'decide p50':>11} {'p99':>9} {'index MiB':>10} {'index pages':>12} {'requests/worker min-max (cv)':>30}")
    if args.ignore_prefill_ahead:
        Worker.prefill_backlog = property(lambda self: 0)
    for n in args.workers:
        t0 = time.perf_counter()
        r = simulate(n, args, "cache")
        rnd = simulate(n, args, "random")
        lo, hi, cv = r["spread"]
        ttft = (f"{r['ttft_p50'] * 1e3:.0f}/{r['ttft_p90'] * 1e3:.0f} ms "
                f"({rnd['ttft_p50'] * 1e3:.0f}/{rnd['ttft_p90'] * 1e3:.0f})")
        print(f"{n:>8} {r['hit']:>6.1%} {r['oracle']:>6.1%} {rnd['hit']:>6.1%} {r['queued']:>6.1%} {ttft:>28} "
              f"{r['p50_us']:>9.0f}us "
              f"{r['p99_us']:>7.0f}us {r['memory_mib']:>10.1f} {r['index_pages']:>12,} "
              f"{f'{lo}-{hi} ({cv:.2f})':>30}   [{time.perf_counter() - t0:.0f} s]")


if __name__ == "__main__":
    main()
