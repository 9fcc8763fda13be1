"""The model service on a CUDA GPU with the torch attention backend.

- float32: greedy tokens equal transformers' `generate` on the same GPU, token for token, on the
  tiny and bench models, with every request in flight at once, under chunked prefill, and again
  as prefix hits;
- bfloat16: the model's logits are as far from float32's as transformers' own bfloat16 logits
  are (bfloat16 rounding, nothing more), and the engine serves in it;
- the profile run gives the page pool what --gpu-memory-utilization leaves.

The flash_attn backend has its own module (tests/service/test_flash_attn.py). Everything here
is skipped where CUDA is not available, as in CI.
"""

from __future__ import annotations

import gc
import random
from pathlib import Path

import pytest
import torch

from kvserve.model_service.kv_cache import bytes_per_page
from kvserve.model_service.tiny_model import make_preset
from tests.engine.harness import EngineHarness, assert_same_tokens, hf_greedy

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

MODELS = ["tiny", "bench"]
NEW_TOKENS = 16
LENGTHS = (1, 5, 17, 40, 100, 130, 257, 300)   # within a page, across pages, many pages


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("gpu-models")
    return {name: make_preset(root / name, name) for name in MODELS}


def prompts_for(vocab: int) -> list[list[int]]:
    rng = random.Random(5)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in LENGTHS]


def hf_model(path: Path, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to("cuda").eval()


@pytest.fixture(scope="module")
def hf_refs(checkpoints):
    """name -> (prompts, transformers' float32 greedy continuation and margins for each)."""
    cache = {}

    def get(name: str):
        if name not in cache:
            hf = hf_model(checkpoints[name], torch.float32)
            prompts = prompts_for(hf.config.vocab_size)
            cache[name] = (prompts, [hf_greedy(hf, p, NEW_TOKENS) for p in prompts])
            del hf
            torch.cuda.empty_cache()
        return cache[name]

    return get


def release() -> None:
    gc.collect()
    torch.cuda.empty_cache()


@pytest.mark.parametrize("chunk", [None, 64], ids=["batched", "chunked"])
@pytest.mark.parametrize("name", MODELS)
def test_float32_torch_backend_equals_transformers(checkpoints, hf_refs, name, chunk) -> None:
    prompts, refs = hf_refs(name)
    config = {} if chunk is None else {"max_num_batched_tokens": chunk}
    h = EngineHarness(checkpoints[name], device="cuda", dtype="float32", attention_backend="torch",
                      page_size=16, num_pages=512, **config)
    try:
        assert h.stack.device.type == "cuda" and h.stack.backend_name == "torch"
        for round_ in ("cold", "prefix hits"):
            outcomes = h.run(prompts, NEW_TOKENS)
            for i, (o, (ref, margins)) in enumerate(zip(outcomes, refs)):
                assert o.finished.completion_tokens == NEW_TOKENS
                assert_same_tokens(o.tokens, ref, margins, f"{name}, {round_}, prompt {i}")
            if round_ == "prefix hits":   # a prompt longer than a page found its pages cached
                assert all(o.prefill.cached_tokens > 0 for o, n in zip(outcomes, LENGTHS) if n > 16)
        assert h.stats().num_sequences == 0
    finally:
        h.close()
        release()


def test_bfloat16_logits_within_bfloat16_rounding(checkpoints) -> None:
    """Every position's logits of one prompt through our bf16 model (torch backend, paged) against
    transformers in float32: no further than transformers' own bf16 logits are (with a margin
    for two different roundings), and the greedy tokens of a bf16 engine run come out."""
    from kvserve.model_service.attention.select import torch_attention
    from kvserve.model_service.dummy_step import prompt_batch
    from kvserve.model_service.kv_cache import KVCache
    from kvserve.model_service.model.loader import load_model

    path = checkpoints["bench"]
    ours, cfg = load_model(path, torch.bfloat16, "cuda")
    prompt = prompts_for(cfg.vocab_size)[-1]
    batch = prompt_batch(len(prompt), 16, torch.device("cuda"))
    batch.input_ids = torch.tensor(prompt, device="cuda")
    batch.logits_indices = torch.arange(len(prompt), device="cuda")
    cache = KVCache(cfg, -(-len(prompt) // 16), 16, torch.bfloat16, "cuda")
    backend = torch_attention()
    with torch.inference_mode():
        logits16 = ours(batch, cache.layers, backend, backend.prepare(batch))
        ids = torch.tensor([prompt], device="cuda")
        hf32 = hf_model(path, torch.float32)(ids).logits[0].float()
        hf16 = hf_model(path, torch.bfloat16)(ids).logits[0].float()
    ours_err = (logits16 - hf32).abs().max().item()
    hf_err = (hf16 - hf32).abs().max().item()
    print(f"bf16 vs float32 logits, max |diff|: kvserve {ours_err:.4f}, transformers {hf_err:.4f}")
    assert ours_err <= 2 * hf_err
    del ours, cache
    release()

    h = EngineHarness(path, device="cuda", dtype="bfloat16", attention_backend="torch", page_size=16, num_pages=512)
    try:
        outcomes = h.run(prompts_for(cfg.vocab_size), NEW_TOKENS)
        assert all(len(o.tokens) == NEW_TOKENS for o in outcomes)
        assert h.stats().num_sequences == 0
    finally:
        h.close()
        release()


def test_profile_run_sizes_the_pool_from_gpu_memory_utilization(checkpoints) -> None:
    from kvserve.model_service.assembly import build
    from kvserve.model_service.config import ModelServiceConfig

    path = checkpoints["bench"]

    def sized(utilization: float) -> tuple[int, int]:
        stack = build(ModelServiceConfig(model=str(path), kvcache="inprocess", device="cuda", dtype="bfloat16",
                                         attention_backend="torch", gpu_memory_utilization=utilization))
        pages, page_size, cfg = stack.num_pages, stack.page_size, stack.model_config
        del stack
        release()
        return pages, bytes_per_page(cfg, torch.bfloat16, page_size)

    total = torch.cuda.mem_get_info()[1]
    small, per_page = sized(0.3)
    large, _ = sized(0.5)
    assert 0 < small < large
    assert large * per_page <= 0.5 * total
    # Everything but the pages is about the same in both: the 0.2 of the GPU between them is pages,
    # give or take what the first build left outside torch's allocator (library handles).
    assert (large - small) * per_page == pytest.approx(0.2 * total, rel=0.05)
    with pytest.raises(ValueError, match="no room for KV pages"):
        sized(0.001)
