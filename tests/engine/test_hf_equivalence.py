"""The oracle: greedy tokens through the real engine equal transformers' `generate`,
token for token, on tiny random checkpoints of every supported architecture,
with many requests in flight and under chunked prefill, prefix hits and
preemption (recompute and swap)."""

from __future__ import annotations

import random

import pytest
import torch

from tests.engine.harness import EngineHarness, assert_same_tokens, hf_greedy

ARCHS = ["tiny", "tiny-qwen2", "tiny-qwen3", "tiny-mistral", "tiny-llama3"]
NEW_TOKENS = 12
_rng = random.Random(1234)
PROMPTS = [[_rng.randrange(3, 1024) for _ in range(n)] for n in (3, 9, 17, 30, 41, 55, 64, 70)]


@pytest.fixture(scope="module")
def hf_refs(tiny_dirs):
    """arch -> (HF model, its greedy continuation and margins for each of PROMPTS)."""
    from transformers import AutoModelForCausalLM

    cache = {}

    def get(arch):
        if arch not in cache:
            hf = AutoModelForCausalLM.from_pretrained(tiny_dirs[arch], dtype=torch.float32).eval()
            cache[arch] = (hf, [hf_greedy(hf, p, NEW_TOKENS) for p in PROMPTS])
        return cache[arch]

    return get


def check_all(outcomes, refs, what):
    for i, (o, (ref, margins)) in enumerate(zip(outcomes, refs)):
        assert o.finished.reason == "length" and o.finished.completion_tokens == NEW_TOKENS
        assert_same_tokens(o.tokens, ref, margins, f"{what}, prompt {i}")


def run(tiny_dirs, arch, **config):
    h = EngineHarness(tiny_dirs[arch], **config)
    try:
        outcomes = h.run(PROMPTS, NEW_TOKENS)
        return outcomes, h.stats()
    finally:
        h.close()


# auto: the cpu backend (native decode kernel) where it builds; torch: the reference backend.
BACKENDS = ["auto", "torch"]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("arch", ARCHS)
def test_concurrent_requests(tiny_dirs, hf_refs, arch, backend):
    _, refs = hf_refs(arch)
    outcomes, stats = run(tiny_dirs, arch, page_size=4, attention_backend=backend)
    check_all(outcomes, refs, f"{arch} batched, {backend} backend")
    assert stats.used_pages == 0 and stats.num_sequences == 0


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("arch", ARCHS)
def test_chunked_prefill(tiny_dirs, hf_refs, arch, backend):
    _, refs = hf_refs(arch)
    outcomes, _ = run(tiny_dirs, arch, page_size=4, max_num_batched_tokens=16, attention_backend=backend)
    check_all(outcomes, refs, f"{arch} chunked, {backend} backend")


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption(tiny_dirs, hf_refs, arch, mode):
    _, refs = hf_refs(arch)
    swap = {"swap_pages": 64} if mode == "swap" else {}
    pages = 38 if arch == "tiny-mistral" else 24   # a sliding window's sequence may hold two windows' pages
    outcomes, stats = run(tiny_dirs, arch, page_size=4, num_pages=pages, preemption_mode=mode, **swap)
    check_all(outcomes, refs, f"{arch} preempted by {mode}")
    preemptions = stats.preemptions_swap if mode == "swap" else stats.preemptions_recompute
    assert preemptions > 0, "the small pool did not force any preemption"
    assert stats.used_pages == 0


@pytest.mark.parametrize("arch", ARCHS)
def test_prefix_hits(tiny_dirs, hf_refs, arch):
    hf, _ = hf_refs(arch)
    system = [_rng.randrange(3, 1024) for _ in range(37)]
    first, second = system + [5, 6, 7], system + [8, 9, 10, 11]
    # A long turn after the cached prefix: 71 queries behind it (CPU: the matmul path).
    third = system + [(7 * i) % 1000 + 3 for i in range(70)]
    h = EngineHarness(tiny_dirs[arch], page_size=4)
    try:
        (a,) = h.run([first], NEW_TOKENS)
        (b,) = h.run([second], NEW_TOKENS)
        (c,) = h.run([third], NEW_TOKENS)
    finally:
        h.close()
    assert a.prefill.cached_tokens == 0
    assert b.prefill.cached_tokens == c.prefill.cached_tokens == 36  # nine full pages of the system prompt
    for outcome, prompt in ((a, first), (b, second), (c, third)):
        ref, margins = hf_greedy(hf, prompt, NEW_TOKENS)
        assert_same_tokens(outcome.tokens, ref, margins, f"{arch} prefix")


def test_identical_prompts_in_one_batch_agree(tiny_dirs, hf_refs):
    hf, _ = hf_refs("tiny")
    prompt = PROMPTS[5]
    h = EngineHarness(tiny_dirs["tiny"], page_size=4, max_num_batched_tokens=24)
    try:
        outcomes = h.run([prompt] * 4, NEW_TOKENS)
    finally:
        h.close()
    ref, margins = hf_greedy(hf, prompt, NEW_TOKENS)
    for o in outcomes:
        assert_same_tokens(o.tokens, ref, margins, "identical prompts")
    assert len({tuple(o.tokens) for o in outcomes}) == 1


# tiny-mistral slides a window: it runs on the torch backend, whose decode gathers pages itself
@pytest.mark.parametrize("arch", [a for a in ARCHS if a != "tiny-mistral"])
def test_decode_steps_of_a_few_requests_go_straight_to_the_fused_step(tiny_dirs, hf_refs, arch):
    """Where the fused decode step and the cpu backend run, steps of at most 4 decodes take the
    runner's DirectStep (plain ints, no tensors built): the same greedy tokens as transformers,
    one request alone and three together."""
    _, refs = hf_refs(arch)
    h = EngineHarness(tiny_dirs[arch], page_size=4)
    try:
        runner = h.engine.runner
        direct = runner.direct
        if direct is None:
            pytest.skip("the native kernels do not build here: every step builds its tensors")
        rows: list[int] = []

        class Counting:
            max_rows = direct.max_rows

            def __call__(self, ids, *rest):
                rows.append(len(ids))
                return direct(ids, *rest)

        runner.direct = Counting()
        check_all(h.run(PROMPTS[:1], NEW_TOKENS), refs[:1], f"{arch}, one request")
        check_all(h.run(PROMPTS[1:4], NEW_TOKENS), refs[1:4], f"{arch}, three requests")
        assert rows.count(1) >= NEW_TOKENS - 1 and 3 in rows, rows
    finally:
        h.close()
