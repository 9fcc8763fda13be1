"""The gateway with real processes on this machine: cache-aware routing against round-robin and
random, on a multi-turn workload, and what the gateway adds to a request.

    .venv/bin/python bench/gateway_bench.py                  # 2 and 4 workers, the bench model (minutes)
    .venv/bin/python bench/gateway_bench.py --quick          # 2 workers, tiny model, 8 conversations x 3 turns
    .venv/bin/python bench/gateway_bench.py --overhead-only  # only what the gateway adds to one request
    .venv/bin/python bench/gateway_bench.py --context 1024 --stagger 0.25 --server-arg=--num-pages=2048
                                                             # under cache pressure (minutes)
    .venv/bin/python bench/gateway_bench.py --workers 4 --context 768 --stagger 1 1.25 1.5 2 \
        --server-arg=--num-pages=2048 --routings cache round-robin   # the ratio as arrivals thin out

Workers: `kvserve up` each (a model service and its manager; `--cpu-threads 1`, as N workers share
this machine's cores), started once per fleet size. For each routing (cache, round-robin,
random, in that order) every worker's manager is reset (empty caches) and a fresh
`kvserve gateway --routing R` is started in front of them.

Workload: `--conversations` conversations of `--turns` turns, running at once (the n-th starts
n x `--stagger` seconds in; several values: the whole workload at each, every routing in turn), each turn sent when the previous reply is in: a shared system prompt
(`--system` tokens), a document of the conversation's own (`--context` tokens, default none),
then per turn a user message of 24-48 random tokens, and a greedy reply of `--reply` tokens (EOS
ignored). Cache pressure comes from `--server-arg=--num-pages=N`: a fleet whose caches together
hold every conversation, but no single worker's does.
Printed per routing: time to first token (mean, p90) as the client sees it, the prefix-hit rate
(cached / prompt tokens, from each PrefillDone) beside an oracle's (the longest prefix of each
prompt that any prefill or reply had computed by the time its own prefill was done, nothing
evicted: the hits of a router that knew every cache, an upper bound) and the share of it
reached, the prompt tokens actually computed, and output tokens per second over the run.

Overhead: 200 one-token requests of 16 tokens to a worker directly, 200 through the bare relay
(bench/bare_relay.py: the same hop with nothing else, the floor of a Python gRPC proxy) and 200
through the gateway (cache routing), taking turns so that the machine's drift falls on all; p50
and p90 of the whole call, and the median of the paired differences from the direct call: what
the hop costs, and what the gateway adds to it (hashing, routing, its queue, failover's books).
The direct calls and the relays' (one bare relay per worker) go to the workers in turn, as the
gateway spreads its own: how recently a worker answered changes how fast it answers by up to a
millisecond, which the gateway's figure would otherwise carry (docs/benchmarks.md, 27 Nov 2026).
A fourth target, bare_relay.py with no upstream, answers each call at once with the three
messages a worker sends: the cost of one Python gRPC call on this machine, which a relay's hop
adds once more. The workers serve their lane (--lane-listen, protos/kvserve/inference/v1/lane.proto)
and the gateway reaches them over it; a fifth target, a second gateway with --lane off, reaches
them over gRPC, as the bare relay does.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

import grpc

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from kvserve.inference.v1 import inference_pb2 as pb  # noqa: E402
from kvserve.inference.v1 import inference_pb2_grpc as pb_grpc  # noqa: E402
from kvserve.kvcache.v1 import kvcache_pb2 as kv_pb  # noqa: E402
from kvserve.kvcache.v1 import kvcache_pb2_grpc as kv_pb_grpc  # noqa: E402
from kvserve.kvcache_service.contract.hashing import page_hashes  # noqa: E402
from kvserve.model_service.prompt_tokens import resolve_model_path  # noqa: E402
from bench.throughput import Stack, free_port  # noqa: E402

ROUTINGS = ("cache", "round-robin", "random")
CLI = [sys.executable, "-m", "kvserve.services.cli.main", "--log-level", "warning"]


def wait_for(check, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            if check():
                return
        except grpc.RpcError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what} not ready within {timeout:.0f} s")
        time.sleep(0.3)


class Workers:
    """`kvserve up` per worker (bench/throughput.py's Stack), each with --cpu-threads 1."""

    def __init__(self, n: int, model: str, extra: list[str]) -> None:
        self.stacks: list[Stack] = []
        try:
            for _ in range(n):
                self.stacks.append(Stack(Path(model), ["--device", "cpu", "--cpu-threads", "1",
                                                       "--lane-listen", "127.0.0.1:0", *extra]))
        except BaseException:
            self.close()
            raise
        self.addresses = [s.address for s in self.stacks]

    def reset(self) -> None:
        """Every worker's prefix cache emptied (the managers' admin Reset)."""
        for s in self.stacks:
            with grpc.insecure_channel(s.kv_address) as ch:
                kv_pb_grpc.KVCacheManagerStub(ch).Reset(kv_pb.ResetRequest(), timeout=10)

    def close(self) -> None:
        for s in self.stacks:
            s.close()


class Gateway:
    def __init__(self, workers: Workers, model: str, routing: str, extra: list[str]) -> None:
        self.address = f"127.0.0.1:{free_port()}"
        self.proc = subprocess.Popen(CLI + ["gateway", "--listen", self.address, "--model", model,
                                            "--routing", routing, *extra, *[x for a in workers.addresses
                                                                     for x in ("--worker", a)]], cwd=ROOT)
        n = len(workers.addresses)
        with grpc.insecure_channel(self.address) as ch:
            stub = pb_grpc.InferenceStub(ch)
            wait_for(lambda: sum(w.state == "serving" and w.events_live for w in stub.GetServerStats(
                pb.GetServerStatsRequest(), timeout=2).workers) == n, 120, "the gateway's workers")

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(60)


# ----------------------------------------------------------------------------- workload

def request(ids: list[int], reply: int) -> pb.GenerateRequest:
    return pb.GenerateRequest(token_ids=pb.TokenIds(ids=ids),
                              sampling=pb.SamplingParams(temperature=0.0, max_tokens=reply, ignore_eos=True))


class Oracle:
    """The hits of a router that knew every cache: a prompt's longest prefix that any request's
    prefill or reply had computed by the time its own prefill was done (nothing evicted, and
    what a prefill in the same step computed counted too: an upper bound; never the page of
    the prompt's last token, which a worker always computes), in tokens."""

    def __init__(self, page_size: int) -> None:
        self.page_size = page_size
        self.computed: set[int] = set()

    def hits(self, ids: list[int]) -> int:
        n = 0
        for h in page_hashes(ids[:len(ids) - 1], self.page_size):
            if h not in self.computed:
                break
            n += 1
        return n * self.page_size

    def add(self, ids: list[int]) -> None:
        self.computed.update(page_hashes(ids, self.page_size))


async def one_turn(stub, ids: list[int], reply: int, oracle: Oracle) -> tuple[float, int, int, int, list[int]]:
    """(time to first token, prompt tokens, cached tokens, the oracle's, the reply)."""
    start = time.perf_counter()
    ttft, prompt, cached, best, out = 0.0, 0, 0, 0, []
    async for r in stub.Generate(request(ids, reply), timeout=600):
        if r.HasField("prefill_done"):
            prompt, cached = r.prefill_done.prompt_tokens, r.prefill_done.cached_tokens
            best = oracle.hits(ids)
            oracle.add(ids)
        elif r.HasField("chunk"):
            if not out:
                ttft = time.perf_counter() - start
            out.extend(r.chunk.token_ids)
    oracle.add(ids + out[:-1])   # (the last token sampled is not computed)
    return ttft, prompt, cached, best, out


async def conversations(address: str, args, vocab: int, stagger: float) -> dict:
    rng = random.Random(11)
    system = [rng.randrange(3, vocab) for _ in range(args.system)]
    users = [[[rng.randrange(3, vocab) for _ in range(rng.randrange(24, 49))] for _ in range(args.turns)]
             for _ in range(args.conversations)]
    documents = [[rng.randrange(3, vocab) for _ in range(args.context)] for _ in range(args.conversations)]
    ttfts: list[tuple[int, float]] = []   # (turn, time to first token)
    prompt, cached, generated, best = 0, 0, 0, 0

    async def talk(stub, c: int, oracle: Oracle) -> None:
        nonlocal prompt, cached, generated, best
        await asyncio.sleep(c * stagger)
        history = system + documents[c]
        for t in range(args.turns):
            history += users[c][t]
            ttft, p, h, b, out = await one_turn(stub, history, args.reply, oracle)
            ttfts.append((t, ttft))
            prompt, cached, generated, best = prompt + p, cached + h, generated + len(out), best + b
            history += out

    async with grpc.aio.insecure_channel(address) as ch:
        stub = pb_grpc.InferenceStub(ch)
        oracle = Oracle((await stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=10)).page_size)
        start = time.perf_counter()
        await asyncio.gather(*(talk(stub, c, oracle) for c in range(args.conversations)))
        wall = time.perf_counter() - start
    every = [x for _, x in ttfts]
    return dict(ttft_mean=statistics.mean(every), ttft_p90=p90(every), first_p90=p90([x for t, x in ttfts if t == 0]),
                later_p90=p90([x for t, x in ttfts if t > 0]), hit=cached / prompt, oracle=best / prompt,
                computed=prompt - cached,
                prompt=prompt, tok_s=generated / wall, wall=wall)


def print_routings(stagger: float, results: dict[str, dict]) -> None:
    print(f"  conversations {stagger} s apart:")
    # first turns: nothing of theirs is cached anywhere; later turns: what routing can find
    print(f"  {'routing':<12} {'TTFT mean':>10} {'TTFT p90':>10} {'first p90':>10} {'later p90':>10} "
          f"{'hit rate':>9} {'oracle':>7} {'of it':>6} {'computed':>9} {'tok/s':>7}")
    for routing, r in results.items():
        share = r["hit"] / r["oracle"] if r["oracle"] else float("nan")
        print(f"  {routing:<12} {r['ttft_mean']:>9.3f}s {r['ttft_p90']:>9.3f}s {r['first_p90']:>9.3f}s "
              f"{r['later_p90']:>9.3f}s {r['hit']:>8.1%} {r['oracle']:>6.1%} {share:>5.0%} "
              f"{r['computed']:>9,} {r['tok_s']:>7.1f}")
    c = results.get("cache")
    for peer in ("round-robin", "random") if c else ():
        if peer not in results:
            continue
        r = results[peer]
        print(f"  cache-aware against {peer}: p90 TTFT {c['ttft_p90'] / r['ttft_p90']:.2f}x (later turns "
              f"{c['later_p90'] / r['later_p90']:.2f}x), "
              f"prompt tokens computed {c['computed'] / r['computed']:.2f}x, tok/s "
              f"{c['tok_s'] / r['tok_s']:.2f}x")


def p90(xs: list[float]) -> float:
    xs = sorted(xs)
    return xs[int(0.9 * (len(xs) - 1))] if xs else float("nan")


class BareRelay:
    """bench/bare_relay.py in front of one worker: the floor of any Python gRPC hop. With
    upstream "-", a server that answers at once: what one Python gRPC call costs here."""

    def __init__(self, upstream: str) -> None:
        self.address = f"127.0.0.1:{free_port()}"
        self.proc = subprocess.Popen([sys.executable, str(ROOT / "bench" / "bare_relay.py"), self.address, upstream])
        with grpc.insecure_channel(self.address) as ch:
            grpc.channel_ready_future(ch).result(timeout=60)

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(60)


def latencies(targets: dict[str, list[str]], n: int = 200) -> tuple[dict[str, tuple[float, float]], dict[str, float]]:
    """One 16-token request, 1 token out, to each target in turn (the workers directly, the bare
    relays, the gateway), their order rotating so that the machine's drift falls on all. A target
    of several addresses takes the one whose turn it is, the turn moving on at every call to any
    target, so that no worker takes two calls in a row as the gateway's spread seldom makes it.
    p50 and p90 of each, and the median of each target's paired differences from the first."""
    rng = random.Random(3)
    names = list(targets)
    times: dict[str, list[float]] = {name: [] for name in names}
    channels = {name: [grpc.insecure_channel(address) for address in addresses] for name, addresses in targets.items()}
    try:
        stubs = {name: [pb_grpc.InferenceStub(ch) for ch in chs] for name, chs in channels.items()}
        calls = 0
        for i in range(n + 10):
            for name in names[i % len(names):] + names[:i % len(names)]:
                ids = [rng.randrange(3, 1000) for _ in range(16)]
                stub = stubs[name][calls % len(stubs[name])]
                calls += 1
                start = time.perf_counter()
                for _ in stub.Generate(request(ids, 1), timeout=60):
                    pass
                if i >= 10:   # warm-up
                    times[name].append(time.perf_counter() - start)
    finally:
        for chs in channels.values():
            for ch in chs:
                ch.close()
    first = names[0]
    paired = {name: statistics.median(t - d for d, t in zip(times[first], times[name])) for name in names[1:]}

    def p50_p90(xs: list[float]) -> tuple[float, float]:
        xs = sorted(xs)
        return xs[len(xs) // 2], xs[int(0.9 * (len(xs) - 1))]
    return {name: p50_p90(xs) for name, xs in times.items()}, paired


def routed_per_worker(gateway: str) -> list[int]:
    """How many requests the gateway sent to each worker (its GetServerStats)."""
    with grpc.insecure_channel(gateway) as ch:
        return [w.requests_routed for w in pb_grpc.InferenceStub(ch).GetServerStats(pb.GetServerStatsRequest()).workers]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="bench")
    ap.add_argument("--workers", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--conversations", type=int, default=32)
    ap.add_argument("--turns", type=int, default=8)
    ap.add_argument("--system", type=int, default=256, help="shared system prompt, in tokens")
    ap.add_argument("--reply", type=int, default=32, help="tokens per reply")
    ap.add_argument("--context", type=int, default=0, help="a document per conversation, in tokens")
    ap.add_argument("--stagger", type=float, nargs="+", default=[0.0],
                    help="seconds between conversation starts (several: a run at each)")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--server-arg", action="append", default=[], help="extra `kvserve up` argument (repeatable)")
    ap.add_argument("--gateway-arg", action="append", default=[],
                    help="extra `kvserve gateway` argument (repeatable), e.g. --gateway-arg=--balance-slack=1")
    ap.add_argument("--routings", nargs="+", default=list(ROUTINGS), choices=ROUTINGS)
    ap.add_argument("--overhead-only", action="store_true",
                    help="skip the conversations: only what the gateway adds to one request (cache routing)")
    ap.add_argument("--overhead-requests", type=int, default=200)
    args = ap.parse_args()
    if args.overhead_only:
        args.routings = ["cache"]
    if args.quick:
        args.model, args.workers, args.conversations, args.turns, args.reply = "tiny", [2], 8, 3, 8
    model = str(resolve_model_path(args.model))
    vocab = json.loads((Path(model) / "config.json").read_text())["vocab_size"]
    print(f"model {Path(model).name}; {args.conversations} conversations x {args.turns} turns, system prompt "
          f"{args.system} tokens, documents of {args.context}, replies of {args.reply}, starts "
          f"{' / '.join(map(str, args.stagger))} s apart; worker flags {args.server_arg}")
    for n in args.workers:
        workers = Workers(n, model, args.server_arg)
        try:
            results = {}   # (stagger, routing) -> its figures
            overhead = None
            for stagger, routing in [(s, r) for s in args.stagger for r in args.routings]:
                workers.reset()
                gateway = Gateway(workers, model, routing, args.gateway_arg)
                try:
                    if not args.overhead_only:
                        results[stagger, routing] = asyncio.run(conversations(gateway.address, args, vocab, stagger))
                    if routing == "cache" and overhead is None:
                        workers.reset()
                        relays = [BareRelay(address) for address in workers.addresses]
                        empty = BareRelay("-")
                        relays.append(empty)
                        over_grpc = Gateway(workers, model, routing, [*args.gateway_arg, "--lane=off"])
                        try:
                            overhead = latencies({"direct": workers.addresses,
                                                  "bare relay": [relay.address for relay in relays[:-1]],
                                                  "gateway": [gateway.address],
                                                  "empty server": [empty.address],
                                                  "gateway, gRPC": [over_grpc.address]}, args.overhead_requests)
                            spread = routed_per_worker(gateway.address)
                        finally:
                            over_grpc.close()
                            for relay in relays:
                                relay.close()
                finally:
                    gateway.close()
            print(f"\n{n} workers:")
            for stagger in args.stagger if results else ():
                print_routings(stagger, {routing: results[stagger, routing] for routing in args.routings})
            if "cache" in args.routings:
                (p50s, paired) = overhead
                print("  one 16-token request, 1 token out, the five in turn, each over every worker: " + ", ".join(
                    f"{name} p50 {p[0] * 1e3:.2f} ms (p90 {p[1] * 1e3:.2f})" for name, p in p50s.items()))
                print(f"  added to a direct call (median of paired differences): the bare relay "
                      f"{paired['bare relay'] * 1e3:+.2f} ms, the gateway (over the workers' lanes) "
                      f"{paired['gateway'] * 1e3:+.2f} ms, the gateway over gRPC (--lane off) "
                      f"{paired['gateway, gRPC'] * 1e3:+.2f} ms; the gateway's own work "
                      f"{(paired['gateway, gRPC'] - paired['bare relay']) * 1e3:+.2f} ms; "
                      f"the gateway's requests per worker {spread}")
                print(f"  the same call to a server that answers at once with no work behind it (one Python "
                      f"gRPC call, the least a relay's hop can add): p50 {p50s['empty server'][0] * 1e3:.2f} ms")
        finally:
            workers.close()


if __name__ == "__main__":
    main()
