"""Parallel sampling (SamplingParams.n) through the real engine: the prompt is computed once and
forked through the manager; every sequence is what a request of its own would give."""

from __future__ import annotations

import random

import pytest
import torch

from kvserve.model_service.engine.family import child_seed
from tests.engine.harness import EngineHarness, Outcome, assert_same_tokens, hf_greedy, wait

N = 4
NEW_TOKENS = 10
_rng = random.Random(77)
# 1 token: nothing to share; 9 and 17: the fork point ends a page (page_size 4); others: it does not
PROMPTS = [[_rng.randrange(3, 1024) for _ in range(n)] for n in (1, 9, 11, 17, 30)]


@pytest.fixture(scope="module")
def hf_model(tiny_dirs):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_dirs["tiny"], dtype=torch.float32).eval()


def _check_sequences(o: Outcome, n: int, max_tokens: int) -> None:
    assert o.failure is None, o.failure
    assert sorted(o.finishes) == list(range(n)) and o.prefills == 1
    for i in range(n):
        assert len(o.sequences[i]) == max_tokens == o.finishes[i].completion_tokens


@pytest.mark.parametrize("config", [
    {},                                                    # whole prompts in one step
    {"max_num_batched_tokens": 8},                         # chunked prefill
    {"num_pages": 40, "preemption_mode": "recompute"},     # too few pages: sequences preempted
    {"num_pages": 40, "max_num_seqs": 4},                  # children that cannot fork go alone
], ids=["batched", "chunked", "preempted", "crowded"])
def test_every_greedy_sequence_equals_transformers(tiny_dirs, hf_model, config):
    h = EngineHarness(tiny_dirs["tiny"], page_size=4, **config)
    try:
        outcomes = [h.submit(p, NEW_TOKENS, n=N) for p in PROMPTS] + [h.submit(PROMPTS[3], NEW_TOKENS)]
        wait(outcomes)
        for p, o in zip(PROMPTS, outcomes):
            _check_sequences(o, N, NEW_TOKENS)
            ref, margins = hf_greedy(hf_model, p, NEW_TOKENS)
            for i in range(N):
                assert_same_tokens(o.sequences[i], ref, margins, f"prompt of {len(p)}, sequence {i}")
        stats = h.stats()
        assert stats.used_pages == 0 and stats.num_sequences == 0
        assert h.engine.counters.finished == len(outcomes)
        forked = sum(N - 1 for p in PROMPTS if len(p) > 1)
        if not config:
            assert h.engine.scheduler.forks == forked   # a child preempted after its fork is re-admitted
        else:   # a child with no room in its parent's fork step is admitted on its own
            assert h.engine.scheduler.forks <= forked
            assert h.engine.scheduler.forks > 0 or config.get("max_num_seqs") == 4   # full of parents
        if "preemption_mode" in config:
            assert h.engine.counters.preemptions["recompute"] > 0
    finally:
        h.close()


def test_each_seeded_sequence_equals_a_request_with_its_derived_seed(tiny_dirs):
    h = EngineHarness(tiny_dirs["tiny"], page_size=4)
    try:
        prompt, seed = PROMPTS[2], 1234
        family = h.submit(prompt, NEW_TOKENS, n=N, temperature=1.0, seed=seed)
        alone = [h.submit(prompt, NEW_TOKENS, temperature=1.0, seed=child_seed(seed, i)) for i in range(N)]
        wait([family, *alone])
        _check_sequences(family, N, NEW_TOKENS)
        for i in range(N):
            assert family.sequences[i] == alone[i].tokens, f"sequence {i}"
        assert len({tuple(family.sequences[i]) for i in range(N)}) > 1   # independent draws
        assert child_seed(seed, 0) == seed
    finally:
        h.close()


@pytest.mark.parametrize("prompt_len, prompt_pages", [(10, 3), (9, 3)])
def test_the_fork_shares_the_prompt_pages(tiny_dirs, prompt_len, prompt_pages):
    """Right after the fork the manager holds the prompt's pages once plus one page per child
    (the copy of the partial last page, or a fresh page when the prompt's pages are full)."""
    h = EngineHarness(tiny_dirs["tiny"], page_size=4)
    seen: dict[int, int] = {}
    try:
        outcome = Outcome(n=8)
        sink = outcome.sink

        def watch(event):   # on the engine thread, in the step that sampled every first token
            sink(event)
            if len(outcome.sequences) == 8 and not seen:
                stats = h.stack.kv.stats()
                seen.update(used=stats.used_pages, seqs=stats.num_sequences)

        from kvserve.model_service.engine.request import Request
        from kvserve.model_service.sampling.params import SamplingParams

        params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=2, n=8)
        h.engine.submit(Request("fork", list(range(3, 3 + prompt_len)), 2, params), watch)
        wait([outcome])
        assert seen == {"used": prompt_pages + 7, "seqs": 8}
        stats = h.stats()
        assert stats.used_pages == 0 and stats.num_sequences == 0
    finally:
        h.close()


def test_cancel_frees_every_sequence(tiny_dirs):
    h = EngineHarness(tiny_dirs["tiny"], page_size=4)
    try:
        outcome = h.submit(PROMPTS[4], 400, n=N)
        assert _wait_for(lambda: len(outcome.sequences) == N)
        assert h.engine.cancel(outcome.request_id)
        assert outcome.done.wait(30)
        assert {f.reason for f in outcome.finishes.values()} == {"abort"}
        stats = h.stats()
        assert stats.used_pages == 0 and stats.num_sequences == 0
        assert h.engine.counters.aborted == 1 and h.engine.num_live() == 0
        # cancelled before the fork: the children never start
        early = h.submit(PROMPTS[4], 400, n=N)
        assert h.engine.cancel(early.request_id)
        assert early.done.wait(30) and len(early.finishes) == N
        assert h.stats().num_sequences == 0
    finally:
        h.close()


def _wait_for(condition, timeout_s: float = 30.0) -> bool:
    import time

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.01)
    return False


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_a_child_that_could_not_fork_reports_its_requests_cached_tokens(tiny_dirs, prefix_caching):
    """No page free for the fork: the child is admitted alone and finds its sibling's pages in
    the cache. Its Finished said that hit (36 of 38 tokens, even with prefix caching off) where
    PrefillDone and sequence 0 said the request's own (0)."""
    h = EngineHarness(tiny_dirs["tiny"], page_size=4, num_pages=10, max_model_len=40,
                      prefix_caching=prefix_caching)
    try:
        (o,) = h.run([list(range(100, 138))], 2, n=2)
        _check_sequences(o, 2, 2)
        assert o.prefill.cached_tokens == 0
        assert [o.finishes[i].cached_tokens for i in range(2)] == [0, 0]
        assert h.stats().used_pages == 0
    finally:
        h.close()
