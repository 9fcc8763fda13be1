"""Prompt logprobs through the real engine equal transformers' log_softmax over the prompt,
position by position, with other requests in the batch, under chunked prefill, recompute
preemption, parallel sampling, and with the prompt's pages already in the prefix cache (which
such a request computes anyway, and still stores)."""

from __future__ import annotations

import random

import pytest
import torch

from tests.engine.harness import EngineHarness, wait

_rng = random.Random(77)
PROMPTS = [[_rng.randrange(3, 1024) for _ in range(n)] for n in (2, 9, 30, 41, 70)]
TOP = 3


@pytest.fixture(scope="module")
def hf_tiny(tiny_dirs):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_dirs["tiny"], dtype=torch.float32).eval()


def reference(hf, prompt: list[int]) -> torch.Tensor:
    """transformers' log_softmax at positions 0 .. len-2: row i gives prompt token i + 1's."""
    with torch.no_grad():
        logits = hf(torch.tensor([prompt])).logits[0].float()
    return torch.log_softmax(logits[:-1], dim=-1)


def check(outcome, prompt: list[int], ref: torch.Tensor, what: str) -> None:
    got = outcome.prefill.prompt_logprobs
    assert got.prompt_ids == prompt, what
    got = got.tokens
    assert len(got) == len(prompt) - 1, what
    for i, lp in enumerate(got):
        token = prompt[i + 1]
        assert lp.token_id == token, (what, i)
        assert lp.logprob == pytest.approx(ref[i, token].item(), abs=1e-4), (what, i)
        top = torch.topk(ref[i], TOP)
        assert [t for t, _ in lp.top] == top.indices.tolist(), (what, i)
        assert [v for _, v in lp.top] == pytest.approx(top.values.tolist(), abs=1e-4), (what, i)


@pytest.mark.parametrize("backend", ["auto", "torch"])
def test_batched_and_chunked(tiny_dirs, hf_tiny, backend):
    """Every prompt at once with 16-token chunks, beside requests that ask for none: each prompt's
    logprobs are transformers', the others' outputs are unchanged, nothing is taken twice."""
    refs = [reference(hf_tiny, p) for p in PROMPTS]
    h = EngineHarness(tiny_dirs["tiny"], page_size=4, max_num_batched_tokens=16, attention_backend=backend)
    try:
        alone = h.run(PROMPTS[2:], 8)
        asked = [h.submit(p, 8, prompt_logprobs=TOP) for p in PROMPTS]
        plain = [h.submit(p, 8) for p in PROMPTS[2:]]
        wait(asked + plain)
    finally:
        h.close()
    for i, (o, p, ref) in enumerate(zip(asked, PROMPTS, refs)):
        check(o, p, ref, f"prompt {i}, {backend} backend")
    assert [o.tokens for o in asked[2:]] == [o.tokens for o in alone] == [o.tokens for o in plain]
    assert all(o.prefill.prompt_logprobs is None for o in plain)


def test_prefix_cache_is_not_read_but_written(tiny_dirs, hf_tiny):
    """The prompt's pages are cached: a request for its logprobs computes them all anyway
    (cached_tokens 0, every position given); a later plain request still hits what it stored."""
    prompt = PROMPTS[4]
    h = EngineHarness(tiny_dirs["tiny"], page_size=4)
    try:
        (warm,) = h.run([prompt], 4)
        asked = h.submit(prompt, 4, prompt_logprobs=TOP)
        wait([asked])
        (again,) = h.run([prompt + [5, 6, 7]], 4)
        stats = h.stats()
    finally:
        h.close()
    assert warm.prefill.cached_tokens == 0 and again.prefill.cached_tokens == 68
    assert asked.prefill.cached_tokens == 0
    check(asked, prompt, reference(hf_tiny, prompt), "behind a cached prefix")
    assert asked.tokens == warm.tokens
    assert stats.used_pages == 0


def test_recompute_preemption(tiny_dirs, hf_tiny):
    """A pool too small for every request: sequences are preempted and computed again, some in
    the middle of their prompt; each position's logprob is still given once, and right."""
    h = EngineHarness(tiny_dirs["tiny"], page_size=4, num_pages=24, max_num_batched_tokens=16,
                      preemption_mode="recompute")
    try:
        outcomes = h.run(PROMPTS, 12, prompt_logprobs=TOP)
        stats = h.stats()
    finally:
        h.close()
    assert stats.preemptions_recompute > 0, "the small pool did not force any preemption"
    for i, (o, p) in enumerate(zip(outcomes, PROMPTS)):
        check(o, p, reference(hf_tiny, p), f"prompt {i}, preempted")
    assert stats.used_pages == 0


def test_parallel_sampling_and_short_prompts(tiny_dirs, hf_tiny):
    """n = 3: the prompt is computed once and its logprobs come once, in the one PrefillDone;
    a prompt of one token has none to give."""
    prompt = PROMPTS[3]
    h = EngineHarness(tiny_dirs["tiny"], page_size=4)
    try:
        family = h.submit(prompt, 6, prompt_logprobs=TOP, n=3, temperature=1.0, seed=3)
        single = h.submit([42], 4, prompt_logprobs=TOP)
        wait([family, single])
    finally:
        h.close()
    assert family.prefills == 1 and sorted(family.sequences) == [0, 1, 2]
    check(family, prompt, reference(hf_tiny, prompt), "n = 3")
    assert single.prefill.prompt_logprobs.prompt_ids == [42] and single.prefill.prompt_logprobs.tokens == []
    assert len(single.tokens) == 4
