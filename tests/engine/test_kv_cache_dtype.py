"""--kv-cache-dtype bfloat16 under a float32 model (CPU): pages of half the bytes, so twice the
tokens in the same memory, each K/V value rounded once as it is written and widened as read.

Greedy tokens through the real engine (many requests, chunked prefill, preemption by swap and
by recompute, prefix hits) stay transformers' float32 ones but where transformers' own top-2
margin is within what that rounding moves a logit (measured on these models: the first
differing position's margin was at most 0.016); pairs the kernels do not run are refused before
the model loads, with the reason."""

from __future__ import annotations

import pytest
import torch

from kvserve.model_service.config import ModelServiceConfig
from kvserve.model_service.dtype_choice import pick_kv_cache_dtype
from tests.engine.harness import EngineHarness, assert_same_tokens, hf_greedy
from tests.engine.test_hf_equivalence import NEW_TOKENS, PROMPTS

CPU, CUDA = torch.device("cpu"), torch.device("cuda")
BF16_KV_TIE = 0.05   # a top-2 margin below this may flip when K/V are rounded to bfloat16


@pytest.fixture(scope="module")
def hf_float32(tiny_dirs):
    """arch -> transformers' float32 greedy continuation and top-2 margins for each of PROMPTS."""
    from transformers import AutoModelForCausalLM

    def get(arch):
        hf = AutoModelForCausalLM.from_pretrained(tiny_dirs[arch], dtype=torch.float32).eval()
        return [hf_greedy(hf, p, NEW_TOKENS) for p in PROMPTS]

    return get


def test_which_pairs_run_and_why_the_others_do_not() -> None:
    f32, bf16 = torch.float32, torch.bfloat16
    assert pick_kv_cache_dtype("auto", f32, CPU) == f32
    assert pick_kv_cache_dtype("auto", bf16, CUDA) == bf16
    assert pick_kv_cache_dtype("bfloat16", f32, CPU) == bf16
    assert pick_kv_cache_dtype("bfloat16", bf16, CUDA) == bf16   # the model's own, anywhere
    with pytest.raises(ValueError, match="wider than the model's bfloat16"):
        pick_kv_cache_dtype("float32", bf16, CPU)
    with pytest.raises(ValueError, match="runs on CPU only"):
        pick_kv_cache_dtype("bfloat16", f32, CUDA)
    with pytest.raises(ValueError, match="narrow only float32 pages, to bfloat16"):
        pick_kv_cache_dtype("float16", f32, CPU)
    with pytest.raises(ValueError, match="--kv-cache-dtype"):
        ModelServiceConfig(kv_cache_dtype="int8")


def test_the_same_memory_holds_twice_the_pages(tiny_dirs) -> None:
    pages = {}
    for name in ("auto", "bfloat16"):
        h = EngineHarness(tiny_dirs["tiny"], kv_cache_memory=1 << 20, page_size=4, kv_cache_dtype=name)
        try:
            pages[name] = h.stack.num_pages
            assert h.stack.kv_cache_dtype == getattr(torch, "float32" if name == "auto" else name)
            assert h.engine.runner.kv_cache.pool.dtype == h.stack.kv_cache_dtype
        finally:
            h.close()
    assert pages["bfloat16"] == 2 * pages["auto"]


@pytest.mark.parametrize("backend", ["auto", "torch"])
@pytest.mark.parametrize("arch", ["tiny", "tiny-qwen3", "tiny-mistral", "tiny-llama3"])
def test_greedy_tokens_are_transformers_float32_ones_but_at_near_ties(tiny_dirs, hf_float32, arch, backend):
    """Eight requests at once (decode steps of many rows and, as they finish, of a few: the
    fused step), prompts chunked at 16 tokens and pages of 4, so every attention path reads
    bfloat16 pages: decode kernel or gathered SDPA, chunks behind cached pages."""
    refs = hf_float32(arch)
    h = EngineHarness(tiny_dirs[arch], page_size=4, attention_backend=backend, kv_cache_dtype="bfloat16",
                      max_num_batched_tokens=16)
    try:
        assert h.engine.runner.kv_cache.pool.dtype == torch.bfloat16
        outcomes = h.run(PROMPTS, NEW_TOKENS)
    finally:
        h.close()
    check_near(outcomes, refs, f"{arch}, {backend}")


def check_near(outcomes, refs, what) -> None:
    for i, (o, (ref, margins)) in enumerate(zip(outcomes, refs)):
        assert o.finished.reason == "length" and o.finished.completion_tokens == NEW_TOKENS
        near = [m if m >= BF16_KV_TIE else 0.0 for m in margins]   # bfloat16 K/V's ties count as ties
        assert_same_tokens(o.tokens, ref, near, f"{what}, prompt {i}")


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preempted_sequences_keep_their_bfloat16_pages(tiny_dirs, hf_float32, mode) -> None:
    """A pool too small for the eight requests: swapped pages go to a bfloat16 CPU pool and back
    byte for byte, recomputed ones are written again, and the tokens stay transformers'."""
    swap = {"swap_pages": 64} if mode == "swap" else {}
    h = EngineHarness(tiny_dirs["tiny"], page_size=4, num_pages=24, preemption_mode=mode,
                      kv_cache_dtype="bfloat16", **swap)
    try:
        assert h.engine.runner.kv_cache.cpu_pool.dtype == torch.bfloat16
        outcomes = h.run(PROMPTS, NEW_TOKENS)
        stats = h.stats()
    finally:
        h.close()
    check_near(outcomes, hf_float32("tiny"), f"preempted by {mode}")
    assert (stats.preemptions_swap if mode == "swap" else stats.preemptions_recompute) > 0
    assert stats.used_pages == 0


def test_a_prefix_hit_reads_the_cached_bfloat16_pages(tiny_dirs) -> None:
    """The second request's prompt shares nine full pages with the first's: it attends to them
    as they were written (rounded), and its tokens stay transformers' but at bfloat16's ties."""
    from transformers import AutoModelForCausalLM

    system = list(range(40, 77))
    first, second = system + [5, 6, 7], system + [8, 9, 10, 11]
    h = EngineHarness(tiny_dirs["tiny"], page_size=4, kv_cache_dtype="bfloat16")
    try:
        (cold,) = h.run([first], NEW_TOKENS)
        (hit,) = h.run([second], NEW_TOKENS)
    finally:
        h.close()
    assert cold.prefill.cached_tokens == 0 and hit.prefill.cached_tokens == 36
    hf = AutoModelForCausalLM.from_pretrained(tiny_dirs["tiny"], dtype=torch.float32).eval()
    check_near([cold, hit], [hf_greedy(hf, p, NEW_TOKENS) for p in (first, second)], "prefix hit")
