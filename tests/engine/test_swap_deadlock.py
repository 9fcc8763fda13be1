"""Swap preemption on a pool that caps the model length: requests near that length, n > 1 (whose
sequences share their prompt's pages), all at once. A swapped sequence keeps the pages it shares
on the device; when nothing runs and the head of the swapped queue needs those pages, nothing
would ever free them (the engine stepped empty for ever, every stream hanging). Swapped sequences
holding pages another needs go back to be recomputed (the manager sends them back when a Grow
would preempt its own sequence for their pages, kvcache_service/core/step.py; the engine the
ones behind the swapped queue's head when nothing runs), and every request ends with the tokens
a recompute-mode run gives."""

from __future__ import annotations

import random

import pytest

from kvserve.kvcache_service.contract.types import PreemptionMode
from kvserve.model_service.engine.request import Status
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
    got, sent_back, stats = run(tiny_dirs, "swap")
    assert sent_back > 0, "the workload no longer reaches the swapped sequences' pages it was made for"
    assert stats.preemptions_swap > 0 and stats.used_pages == 0
    for i, (a, b) in enumerate(zip(got, want)):
        assert a.sequences == b.sequences, i


def _swapped(scheduler, seq_id: int):
    from kvserve.model_service.engine.request import Request
    from kvserve.model_service.sampling.params import SamplingParams

    r = Request(f"r{seq_id}", list(range(1, 9)), 4, SamplingParams(max_tokens=4))
    r.seq_id, r.status, r.num_computed, r.page_table = seq_id, Status.SWAPPED, 8, [seq_id * 2, seq_id * 2 + 1]
    r.order = seq_id
    scheduler.swapped.append(r)
    scheduler.by_seq[seq_id] = r
    return r


@pytest.mark.parametrize("preempted", [False, True])
def test_nothing_running_and_the_head_refused_sends_those_behind_it_back(preempted):
    """The engine's own breaker, which the manager's rule leaves rare (the workload above no longer
    reaches it): nothing runs, the swapped queue's head cannot come back, and the sequences behind
    it go back to be recomputed, in their order, ahead of new requests. Not in a step whose plan
    preempted: the manager refuses every resume then, room or not."""
    from kvserve.kvcache_service.contract.types import NeedResult, Preemption, StepPlan
    from kvserve.model_service.engine.scheduler import Scheduler, SchedulerConfig

    scheduler = Scheduler(SchedulerConfig(page_size=4, preemption_mode=PreemptionMode.SWAP))
    head, second, third = (_swapped(scheduler, i) for i in (1, 2, 3))
    proposal = scheduler.build()
    plan = StepPlan(results=[NeedResult(False, need.seq_id, reason="needs 3 pages, 1 available")
                             for need in proposal.step.needs])
    if preempted:   # (a sequence this engine does not list: only the plan's shape matters here)
        plan.preempted.append(Preemption(99, "elsewhere", PreemptionMode.RECOMPUTE))
    scheduler.apply(proposal, plan)
    if preempted:
        assert list(scheduler.swapped) == [head, second, third] and scheduler.unswapped == 0
    else:
        assert list(scheduler.swapped) == [head] and list(scheduler.waiting) == [second, third]
        assert scheduler.unswapped == 2 and sorted(scheduler.build().step.releases) == [2, 3]
        assert second.seq_id is None and second.status is not Status.SWAPPED
