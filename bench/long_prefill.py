#!/usr/bin/env python
"""A short request behind a long prompt's prefill, with and without --long-prefill-token-threshold.

    .venv/bin/python bench/long_prefill.py                          # 4,000-token prompt, thresholds 0 256 512
    .venv/bin/python bench/long_prefill.py --long 2000 --thresholds 0 512 --rounds 3

The bench model on the engine alone (the model service's build, in-process manager, CPU
defaults: --max-num-batched-tokens 2048); its model length (4,096) bounds --long. One request of --long prompt tokens and 8 new ones;
once its prefill has begun (its first step computed), --shorts requests of 32 prompt tokens
and 16 new ones each. Per threshold: the short requests' time to first token (mean, worst),
their time to their last token, and the long request's time to its first token, the price it
pays. Ratios against the first threshold given, in the same run. The prompts' tokens are drawn
at random, with no prefix in common (no cache hit).
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvserve.model_service.assembly import build_on_a_thread_that_ends  # noqa: E402
from kvserve.model_service.config import ModelServiceConfig  # noqa: E402
from kvserve.model_service.engine.events import Failed, Finished, Tokens  # noqa: E402
from kvserve.model_service.engine.request import Request  # noqa: E402
from kvserve.model_service.sampling.params import SamplingParams  # noqa: E402
from kvserve.model_service.tiny_model import default_tiny_path  # noqa: E402


class Timing:
    """One request's first and last token times."""

    def __init__(self) -> None:
        self.first: float | None = None
        self.last: float | None = None
        self.done = threading.Event()
        self.failure: str | None = None

    def __call__(self, event) -> None:
        now = time.perf_counter()
        if isinstance(event, Tokens):
            self.first = self.first or now
            self.last = now
        elif isinstance(event, Finished):
            self.done.set()
        elif isinstance(event, Failed):
            self.failure = str(event)
            self.done.set()


def one_run(engine, rng: random.Random, long_len: int, shorts: int, vocab: int) -> dict:
    def greedy(n: int) -> SamplingParams:
        return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)

    long_prompt = [rng.randrange(3, vocab) for _ in range(long_len)]
    long = Timing()
    start = time.perf_counter()
    steps_before = engine.counters.steps
    engine.submit(Request(f"long-{rng.random()}", long_prompt, 8, greedy(8)), long)
    while engine.counters.steps < steps_before + 1:   # its prefill has begun
        time.sleep(0.001)
    timings, sent = [], time.perf_counter()
    for i in range(shorts):
        t = Timing()
        timings.append(t)
        engine.submit(Request(f"short-{i}-{rng.random()}", [rng.randrange(3, vocab) for _ in range(32)], 16,
                              greedy(16)), t)
    for t in [long, *timings]:
        t.done.wait()
        assert t.failure is None, t.failure
    ttfts = [t.first - sent for t in timings]
    return {"short_ttft": statistics.mean(ttfts), "short_worst": max(ttfts),
            "short_done": statistics.mean(t.last - sent for t in timings), "long_ttft": long.first - start}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--long", type=int, default=4000, help="the long prompt's tokens")
    ap.add_argument("--shorts", type=int, default=4, help="short requests sent once the long prefill began")
    ap.add_argument("--thresholds", type=int, nargs="+", default=[0, 256, 512])
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    path = default_tiny_path("bench")
    results: dict[int, list[dict]] = {}
    for threshold in args.thresholds:
        stack = build_on_a_thread_that_ends(ModelServiceConfig(
            model=str(path), kvcache="inprocess", device="cpu", long_prefill_token_threshold=threshold))
        if args.long + 8 > stack.max_model_len:   # (the engine alone checks no length: the server would refuse it)
            raise SystemExit(f"--long {args.long}: the model length is {stack.max_model_len}")
        engine = stack.engine
        engine.start()
        try:
            rng = random.Random(threshold)
            one_run(engine, rng, 600, 1, stack.model_config.vocab_size)   # warm
            results[threshold] = [one_run(engine, rng, args.long, args.shorts, stack.model_config.vocab_size)
                                  for _ in range(args.rounds)]
        finally:
            engine.stop()
    base = args.thresholds[0]

    def median(threshold: int, key: str) -> float:
        return statistics.median(r[key] for r in results[threshold])

    print(f"a {args.long:,}-token prompt, then {args.shorts} of 32 tokens (16 new) once its prefill began; "
          f"medians of {args.rounds} rounds, ratios against threshold {base}")
    print(f"{'threshold':>9} | {'short TTFT ms':>13} | {'worst':>9} | {'short done ms':>13} | {'long TTFT ms':>12}")
    for threshold in args.thresholds:
        row = [median(threshold, k) for k in ("short_ttft", "short_worst", "short_done", "long_ttft")]
        ratios = [v / median(base, k) for v, k in zip(row, ("short_ttft", "short_worst", "short_done", "long_ttft"))]
        print(f"{threshold:>9} | " + " | ".join(f"{v * 1e3:8.0f} ({r:.2f}x)" for v, r in zip(row, ratios)))


if __name__ == "__main__":
    main()
