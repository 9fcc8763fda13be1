"""Swap preemption on a pool that caps the model length: requests near that length, n > 1 (whose
sequences share their prompt's pages), all at once. A swapped sequence keeps the pages it shares
on the device; when nothing runs and the head of the swapped queue needs those pages, nothing
would ever free them (the engine stepped empty for ever, every stream hanging). The sequences
behind the head go back to be recomputed, and every request ends with the tokens a recompute-mode
run gives."""

from __future__ import annotations

import random

import pytest

from tests.engine.harness import EngineHarness, wait

PAGES, PAGE = 70, 4
LENGTH = PAGES * PAGE   # the model length the pool caps it to


def cases() -> list[tuple[list[int], int, dict]]:
    rng = random.Random(5)
    out = []
    for n in (LENGTH - 1, LENGTH - 5, 2, 130):   # near the cap and short: enough to reach the deadlock often
        prompt = [rng.randrange(3, 1024) for _ in range(n)]
        room = LENGTH - n
        for new in sorted({1, room}):
            for params in (dict(n=3), dict(n=2, prompt_logprobs=2), dict(n=4, temperature=0.9, seed=1),
                           dict(logprobs=1)):
                out.append((prompt, new, params))
    return out


def run(tiny_dirs, mode: str):
    swap = {"swap_pages": 200} if mode == "swap" else {}
    h = EngineHarness(tiny_dirs["tiny"], page_size=PAGE, num_pages=PAGES, preemption_mode=mode,
                      max_num_batched_tokens=64, **swap)
    try:
        outcomes = [h.submit(prompt, new, **params) for prompt, new, params in cases()]
        wait(outcomes, timeout=120)
        stats = h.stats()
        return outcomes, h.engine.scheduler.unswapped, stats
    finally:
        h.close()


@pytest.mark.slow
def test_swapped_sequences_holding_the_heads_pages_go_back_to_be_recomputed(tiny_dirs):
    want, _, _ = run(tiny_dirs, "recompute")
    got, unswapped, stats = run(tiny_dirs, "swap")
    assert unswapped > 0, "the workload no longer reaches the deadlock it was made for"
    assert stats.preemptions_swap > 0 and stats.used_pages == 0
    for i, (a, b) in enumerate(zip(got, want)):
        assert a.sequences == b.sequences, i
