#!/usr/bin/env python
"""What a batch-1 decode step spends around its one native call, A/B in one process: the same
engine (bench model, in-process manager, cpu backend) decodes one greedy request at a time with

    before          the step's tensors built (ForwardBatch, prepare, embedding, RoPE lookup) and
                    torch.argmax for the greedy token
    direct          the runner's DirectStep (plain ints to the fused step), torch.argmax
    direct+argmax   DirectStep and the sampler's own argmax (kernels/row_argmax.c or numpy)

round after round, the three in turn, so that the machine's drift falls on all of them.
Printed per mode: the median over rounds of the gap between tokens (p50 within a request) and
of the engine's forward and sample phases per step.

    .venv/bin/python bench/step_overhead.py                        # bfloat16 and float32, prompt 32
    .venv/bin/python bench/step_overhead.py --dtypes bfloat16 --prompt 512 --rounds 8
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

MODES = ("before", "direct", "direct+argmax")


def child(dtype: str, prompt_len: int, new_tokens: int, rounds: int) -> None:
    from bench.single_stream import greedy_token_times
    from kvserve.model_service.assembly import build_on_a_thread_that_ends
    from kvserve.model_service.config import ModelServiceConfig
    from kvserve.model_service.sampling import sampler
    from kvserve.model_service.tiny_model import default_tiny_path

    stack = build_on_a_thread_that_ends(ModelServiceConfig(model=str(default_tiny_path("bench")), kvcache="inprocess",
                                                           device="cpu", dtype=dtype))
    engine, runner = stack.engine, stack.engine.runner
    direct, own_argmax = runner.direct, sampler.row_argmax
    if direct is None:
        sys.exit("no DirectStep here: the fused decode step or the cpu backend is not available")
    engine.start()
    sent = 0

    def one(prompt: list[int], n: int) -> list[float]:
        nonlocal sent
        sent += 1
        return greedy_token_times(engine, prompt, n, f"r{sent}")

    one(list(range(3, 40)), 8)   # warm-up
    results = {mode: [] for mode in MODES}
    try:
        for r in range(rounds):
            for mode in MODES:
                runner.direct = None if mode == "before" else direct
                sampler.row_argmax = own_argmax if mode == "direct+argmax" else (lambda x: x.argmax(dim=-1))
                c = engine.counters
                forward, sample, steps = c.forward_s, c.sample_s, c.steps
                times = one([3 + (r * 7 + i) % 500 for i in range(prompt_len)], new_tokens)
                n = c.steps - steps
                results[mode].append((statistics.median(b - a for a, b in zip(times, times[1:])) * 1e3,
                                      (c.forward_s - forward) * 1e3 / n, (c.sample_s - sample) * 1e3 / n))
    finally:
        runner.direct, sampler.row_argmax = direct, own_argmax
        engine.stop()
    base = statistics.median(g for g, _, _ in results["before"])
    for mode, runs in results.items():
        gap, forward, sample = (statistics.median(x[i] for x in runs) for i in range(3))
        print(f"  {dtype:<9} prompt {prompt_len:<5} {mode:<14} gap p50 {gap:.3f} ms ({gap / base:.2f}x)  forward "
              f"{forward:.3f}  sample {sample:.3f}   rounds: {', '.join(f'{x[0]:.2f}' for x in runs)}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"])
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--child", nargs=4, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        dtype, prompt_len, new_tokens, rounds = args.child
        child(dtype, int(prompt_len), int(new_tokens), int(rounds))
        return
    print(f"one greedy request at a time, bench model, {args.new_tokens} new tokens, {args.rounds} rounds")
    for dtype in args.dtypes:   # a process per dtype, as the model service has one dtype
        subprocess.run([sys.executable, __file__, "--child", dtype, str(args.prompt), str(args.new_tokens),
                        str(args.rounds)], check=True)


if __name__ == "__main__":
    main()
