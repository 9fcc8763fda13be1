"""What a manager failure costs the requests in flight, and what a long storm leaves behind.

    .venv/bin/python bench/faults.py                      # 3 kills, then a 1-minute soak
    .venv/bin/python bench/faults.py --kills 3 --minutes 5
    .venv/bin/python bench/faults.py --minutes 0          # the kills only

Both parts run `kvserve up --model tiny` (CPU, float32) as real processes.

Recovery: 8 greedy streams of 400 tokens, once undisturbed and once while the manager is killed
(-9) `--kills` times, each time once every stream has moved on. `kvserve up` restarts the manager;
the model service re-registers a new epoch and re-admits every request as prompt + tokens so far.
Printed: whether every stream's tokens equal the undisturbed run's (they must), the time from each
kill to each stream's first token after the recovery (p50, max; "after the recovery" is after the
last GetServerStats poll, every 20 ms, that still saw the manager unreachable), and the extra time
each request took against the undisturbed run.

Soak: `--streams` concurrent streams for `--minutes`, each replaced as it ends, each one of: run to
the end, cancel after a few tokens, a deadline of 10 ms-1 s, drop its connection, or cancel by id
from another call. Printed: requests served, calls by status code, pages and sequences the manager
still holds once the storm is over, and the RSS of each process at start and end.

The anchors, for comparison: in vLLM an engine death fails every in-flight request
(EngineDeadError) and the server must be restarted; Dynamo moves a request to another worker only
when asked to (`--migration-limit`, default 0).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import signal
import statistics
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import grpc

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from kvserve.inference.v1 import inference_pb2 as pb  # noqa: E402
from kvserve.inference.v1 import inference_pb2_grpc as pb_grpc  # noqa: E402
from kvserve.kvcache.v1 import kvcache_pb2 as kv_pb  # noqa: E402
from kvserve.kvcache.v1 import kvcache_pb2_grpc as kv_pb_grpc  # noqa: E402
from bench.throughput import Stack, request  # noqa: E402

MODEL_FLAGS = ["--device", "cpu", "--dtype", "float32", "--page-size", "16", "--num-pages", "4096"]
POLL_S = 0.02


# ----------------------------------------------------------------------------- recovery

class Timed:
    """One Generate stream on a thread: each token with its arrival time, and how it ended."""

    def __init__(self, address: str, prompt: list[int], new_tokens: int) -> None:
        self.tokens: list[int] = []
        self.times: list[float] = []
        self.code: grpc.StatusCode | None = None
        self.start = time.perf_counter()
        self.end = 0.0
        self._thread = threading.Thread(target=self._run, args=(address, prompt, new_tokens), daemon=True)
        self._thread.start()

    def _run(self, address: str, prompt: list[int], new_tokens: int) -> None:
        with grpc.insecure_channel(address) as ch:
            try:
                for event in pb_grpc.InferenceStub(ch).Generate(request(prompt, new_tokens), timeout=300):
                    now = time.perf_counter()
                    for t in event.chunk.token_ids:
                        self.tokens.append(t)
                        self.times.append(now)
                self.code = grpc.StatusCode.OK
            except grpc.RpcError as exc:
                self.code = exc.code()
        self.end = time.perf_counter()

    def join(self) -> None:
        self._thread.join(600)

    @property
    def seconds(self) -> float:
        return self.end - self.start


class StatsPoller:
    """GetServerStats every POLL_S: (time, manager_losses, manager_reachable)."""

    def __init__(self, address: str) -> None:
        self.samples: list[tuple[float, int, bool]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(address,), daemon=True)
        self._thread.start()

    def _run(self, address: str) -> None:
        with grpc.insecure_channel(address) as ch:
            stub = pb_grpc.InferenceStub(ch)
            while not self._stop.wait(POLL_S):
                try:
                    s = stub.GetServerStats(pb.GetServerStatsRequest(), timeout=2)
                except grpc.RpcError:
                    continue
                self.samples.append((time.perf_counter(), s.manager_losses, s.manager_reachable))

    def recovered(self, losses: int) -> float | None:
        """The last time the poller saw the manager unreachable before loss number `losses`
        ended; None while that loss is not over."""
        last_down = None
        for t, n, reachable in self.samples:
            if n >= losses and not reachable:
                last_down = t
            elif n >= losses and reachable and last_down is not None:
                return last_down
        return None

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)


def manager_pid(stack: Stack) -> int:
    return stack.children()["manager"]


def run_streams(stack: Stack, prompts: list[list[int]], new_tokens: int, kills: int) -> tuple[list[Timed], list[float],
                                                                                                  list[float]]:
    """The streams, with `kills` manager kills spread over them. Returns the streams, the kill
    times and the recovery times."""
    poller = StatsPoller(stack.address)
    streams = [Timed(stack.address, p, new_tokens) for p in prompts]
    kill_times, recovered_at = [], []
    for k in range(kills):
        goal = (k + 1) * new_tokens // (kills + 1)
        while min(len(s.tokens) for s in streams) < goal:
            time.sleep(0.005)
        kill_times.append(time.perf_counter())
        os.kill(manager_pid(stack), signal.SIGKILL)
        deadline = time.perf_counter() + 120
        while (t := poller.recovered(k + 1)) is None:
            if time.perf_counter() > deadline:
                raise RuntimeError(f"the model service did not recover from kill {k + 1} within 120 s")
            time.sleep(POLL_S)
        recovered_at.append(t)
    for s in streams:
        s.join()
    poller.stop()
    return streams, kill_times, recovered_at


def first_tokens_after(streams: list[Timed], kill_times: list[float], recovered_at: list[float]) -> list[float]:
    """Kill -> the first token after the recovery, for every stream still running at each kill."""
    out = []
    for killed, back in zip(kill_times, recovered_at):
        for s in streams:
            after = [t for t in s.times if t > back]
            if s.end > killed and after:
                out.append(after[0] - killed)
    return out


def recovery(args) -> None:
    stack = Stack("tiny", [*MODEL_FLAGS, "--max-restarts", str(args.kills + 2)])
    try:
        rng = random.Random(7)
        prompts = [[rng.randrange(3, 1000) for _ in range(rng.randrange(8, 80))] for _ in range(args.recovery_streams)]
        for _ in stack.stub.Generate(request(list(range(3, 35)), 4)):  # warm-up
            pass
        quiet, _, _ = run_streams(stack, prompts, args.tokens, 0)
        hurt, kill_times, recovered_at = run_streams(stack, prompts, args.tokens, args.kills)
        same = all(q.tokens == h.tokens and h.code == grpc.StatusCode.OK for q, h in zip(quiet, hurt))
        firsts = sorted(first_tokens_after(hurt, kill_times, recovered_at))
        extra = [h.seconds - q.seconds for q, h in zip(quiet, hurt)]
        print(f"\nrecovery: {len(prompts)} greedy streams x {args.tokens} tokens, the manager killed -9 "
              f"{args.kills} times")
        print(f"  tokens equal to the undisturbed run: {'yes, every stream' if same else 'NO'}")
        print(f"  kill -> first token after recovery: p50 {statistics.median(firsts):.2f} s, "
              f"max {max(firsts):.2f} s ({len(firsts)} stream-kills)")
        print("  kill -> recovery seen, per kill: "
              + ", ".join(f"{b - k:.2f} s" for k, b in zip(kill_times, recovered_at)))
        print(f"  request time: undisturbed mean {statistics.mean(q.seconds for q in quiet):.2f} s, "
              f"with the kills {statistics.mean(h.seconds for h in hurt):.2f} s; "
              f"extra per request mean {statistics.mean(extra):.2f} s, max {max(extra):.2f} s "
              f"({max(extra) / args.kills:.2f} s per kill)")
        if not same:
            raise SystemExit("tokens differ after a manager kill")
    finally:
        stack.close()


# ----------------------------------------------------------------------------- soak

def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


async def one_call(address: str, stub, rng: random.Random, n: int, codes: Counter) -> None:
    kind = rng.choice(["finish", "cancel", "deadline", "drop", "cancel-rpc"])
    msg = pb.GenerateRequest(
        request_id=f"soak-{n}", token_ids=pb.TokenIds(ids=[rng.randrange(3, 1000) for _ in range(rng.randrange(1, 120))]),
        sampling=pb.SamplingParams(temperature=rng.choice([0.0, 0.8]), seed=n, max_tokens=rng.randrange(1, 64),
                                   ignore_eos=True))
    own = grpc.aio.insecure_channel(address) if kind == "drop" else None
    call = (pb_grpc.InferenceStub(own) if own else stub).Generate(
        msg, timeout=rng.uniform(0.01, 1.0) if kind == "deadline" else 120)
    stop_after, seen = rng.randrange(0, 6), 0
    try:
        async for _ in call:
            seen += 1
            if seen == stop_after:
                if kind == "cancel":
                    call.cancel()
                elif kind == "drop":
                    await own.close()
                elif kind == "cancel-rpc":
                    try:
                        await stub.Cancel(pb.CancelRequest(request_id=msg.request_id), timeout=10)
                    except grpc.aio.AioRpcError as exc:
                        codes[f"Cancel {exc.code().name}"] += 1
        codes["OK"] += 1
    except asyncio.CancelledError:
        codes["CANCELLED"] += 1
    except grpc.aio.AioRpcError as exc:
        codes[exc.code().name] += 1
    finally:
        if own is not None:
            await own.close()


async def storm(address: str, streams: int, seconds: float) -> Counter:
    codes: Counter = Counter()
    rng = random.Random(2026)
    stop_at = time.perf_counter() + seconds
    started = 0

    async with grpc.aio.insecure_channel(address) as ch:
        stub = pb_grpc.InferenceStub(ch)

        async def lane() -> None:
            nonlocal started
            while time.perf_counter() < stop_at:
                started += 1
                await one_call(address, stub, rng, started, codes)

        await asyncio.gather(*(lane() for _ in range(streams)))
    return codes


def soak(args) -> None:
    stack = Stack("tiny", MODEL_FLAGS)
    try:
        for _ in stack.stub.Generate(request(list(range(3, 35)), 4)):  # warm-up
            pass
        pids = {"kvserve up": stack.proc.pid, **stack.children()}
        before = {name: rss_mib(pid) for name, pid in pids.items()}
        codes = asyncio.run(storm(stack.address, args.streams, args.minutes * 60))
        # the manager's pages come back once the engine has seen every cancel; wait, bounded
        deadline = time.perf_counter() + 30
        with grpc.insecure_channel(stack.kv_address) as ch:
            kv = kv_pb_grpc.KVCacheManagerStub(ch)
            while (s := kv.GetStats(kv_pb.GetStatsRequest(), timeout=5)).used_pages and time.perf_counter() < deadline:
                time.sleep(0.1)
        after = {name: rss_mib(pid) for name, pid in pids.items()}
        server = stack.stub.GetServerStats(pb.GetServerStatsRequest())
        print(f"\nsoak: {args.streams} concurrent streams for {args.minutes:g} min, random cancels, deadlines, "
              f"dropped connections")
        print(f"  calls: {sum(v for k, v in codes.items() if not k.startswith('Cancel '))}; "
              f"requests served to the end: {codes['OK']}")
        print("  by code: " + ", ".join(f"{k} {v}" for k, v in codes.most_common()))
        print(f"  afterwards: the manager holds {s.used_pages} pages and {s.num_sequences} sequences; "
              f"model service requests_failed {server.requests_failed}")
        for name in pids:
            print(f"  RSS {name}: {before[name]:.0f} MiB at start, {after[name]:.0f} MiB at end")
        if s.used_pages or s.num_sequences or set(codes) & {"UNKNOWN", "INTERNAL"}:
            raise SystemExit("the soak left pages behind or met UNKNOWN/INTERNAL")
    finally:
        stack.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kills", type=int, default=3, help="manager kills during the recovery run (0: skip it)")
    parser.add_argument("--recovery-streams", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=400, help="new tokens per recovery stream")
    parser.add_argument("--minutes", type=float, default=1.0, help="soak length (0: skip it)")
    parser.add_argument("--streams", type=int, default=256, help="concurrent soak streams")
    args = parser.parse_args()
    if args.kills:
        recovery(args)
    if args.minutes:
        soak(args)


if __name__ == "__main__":
    main()
