"""The benchmarks' random prompts, shared by bench/throughput.py and bench/gpu_bench.py."""

from __future__ import annotations

import random


def make_prompts(n: int, lo: int, hi: int, vocab: int, seed: int = 0) -> list[list[int]]:
    """n prompts of lo..hi random token ids in [3, vocab), the same for the same seed."""
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randrange(lo, hi + 1))] for _ in range(n)]
