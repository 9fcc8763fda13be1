#!/usr/bin/env python
"""Parallel sampling: one request with n = 8 against 8 separate requests of the same prompt.

    .venv/bin/python bench/parallel_sampling.py                       # bench model, 1024-token prompt
    .venv/bin/python bench/parallel_sampling.py --prompt 2000 --new-tokens 64 --rounds 5

Both runs sample the same tokens: the separate requests take the seeds the n = 8 request's
sequences derive (engine/family.py's child_seed), so the only difference is how the prompt is
held. On the engine alone (the model service's build, in-process manager), each run measures
the prompt tokens the forward computed, the time until every sequence finished, and the most
KV pages in use at once (read from the manager after every step). Rounds alternate between the
two; the table gives medians and the ratio n=8 / separate.
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
from kvserve.model_service.engine.events import Failed, Finished  # noqa: E402
from kvserve.model_service.engine.family import child_seed  # noqa: E402
from kvserve.model_service.engine.request import Request  # noqa: E402
from kvserve.model_service.sampling.params import SamplingParams  # noqa: E402
from kvserve.model_service.sampling.sampler import make_generator  # noqa: E402
from kvserve.model_service.tiny_model import default_tiny_path  # noqa: E402


class Meter:
    """Wraps the runner: prompt rows computed (rows before a sequence's first output token) and
    the peak of the manager's used pages, after every step."""

    def __init__(self, stack) -> None:
        self.stack, self.runner = stack, stack.engine.runner
        self.inner = self.runner.execute
        self.runner.execute = self.execute
        self.prompt_rows = self.peak_pages = 0

    def reset(self) -> None:
        self.prompt_rows = self.peak_pages = 0

    def execute(self, work):
        for w in work:
            self.prompt_rows += max(0, min(w.start + w.count, w.request.num_prompt) - w.start)
        self.peak_pages = max(self.peak_pages, self.stack.kv.stats().used_pages)
        return self.inner(work)


def run(engine, requests: list[Request], sequences: int) -> tuple[float, list[Finished]]:
    finished: list[Finished] = []
    done = threading.Semaphore(0)

    def sink(event) -> None:
        if isinstance(event, (Finished, Failed)):
            finished.append(event)
            done.release()

    start = time.perf_counter()
    for r in requests:
        engine.submit(r, sink)
    for _ in range(sequences):
        done.acquire()
    wall = time.perf_counter() - start
    assert all(isinstance(f, Finished) for f in finished), finished
    return wall, finished


def make(request_id: str, prompt: list[int], new_tokens: int, seed: int, n: int, device) -> Request:
    params = SamplingParams(temperature=0.8, seed=seed, max_tokens=new_tokens, ignore_eos=True, n=n)
    r = Request(request_id, list(prompt), new_tokens, params)
    r.generator = make_generator(seed, device)
    return r


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="checkpoint dir (default: the generated bench model)")
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=1024, help="prompt tokens")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()

    path = Path(args.model) if args.model else default_tiny_path("bench")
    stack = build_on_a_thread_that_ends(ModelServiceConfig(model=str(path), kvcache="inprocess", device="cpu",
                                                           max_n=max(16, args.n)))
    engine, device = stack.engine, stack.device
    meter = Meter(stack)
    engine.start()
    rng = random.Random(0)
    rows: dict[str, list[tuple[float, int, int]]] = {"n": [], "separate": []}
    try:
        run(engine, [make("warm", [5, 6, 7, 8], 4, 0, 1, device)], 1)
        for k in range(args.rounds):
            seed = 1000 + k
            order = ("n", "separate") if k % 2 == 0 else ("separate", "n")
            for kind in order:
                # a prompt of its own: no run finds another's pages cached
                prompt_k = [rng.randrange(3, stack.model_config.vocab_size) for _ in range(args.prompt)]
                if kind == "n":
                    requests = [make(f"n{k}", prompt_k, args.new_tokens, seed, args.n, device)]
                else:
                    requests = [make(f"s{k}-{i}", prompt_k, args.new_tokens, child_seed(seed, i), 1, device)
                                for i in range(args.n)]
                assert engine.wait_idle(60)
                meter.reset()
                wall, finished = run(engine, requests, args.n)
                assert sum(f.completion_tokens for f in finished) == args.n * args.new_tokens
                rows[kind].append((wall, meter.prompt_rows, meter.peak_pages))
    finally:
        engine.stop()

    def med(kind: str, i: int) -> float:
        return statistics.median(r[i] for r in rows[kind])

    print(f"model {path.name}, page size {stack.page_size}, prompt {args.prompt} tokens, n = {args.n}, "
          f"{args.new_tokens} new tokens each, temperature 0.8, {args.rounds} rounds (medians)")
    print(f"{'':>22} {'n = %d' % args.n:>12} {'%d separate' % args.n:>12} {'ratio':>8}")
    for name, i, fmt in (("time to all finished s", 0, "{:.2f}"), ("prompt tokens computed", 1, "{:.0f}"),
                         ("peak KV pages", 2, "{:.0f}")):
        a, b = med("n", i), med("separate", i)
        print(f"{name:>22} {fmt.format(a):>12} {fmt.format(b):>12} {a / b:>8.2f}")


if __name__ == "__main__":
    main()
