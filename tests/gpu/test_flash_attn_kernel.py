"""The flash_attn backend's paged attention against the torch backend's, op by op, on the GPU.

Random queries and a page pool of random stale bytes, sequences on scattered pages; steps of
decodes only (flash-attn 2: its kvcache function), prefill chunks behind a cached prefix and
mixed steps (the varlen function with a block table); page sizes that take flash-attn 4's TMA
path (a page holding one key tile) and its other one. Both backends write the step's K/V into
their own copy of the pool first; outputs and pools must agree within bfloat16 rounding.
Skipped without CUDA or without an importable flash-attn.
"""

from __future__ import annotations

import pytest
import torch

from kvserve.model_service.attention.flash_attn_backend import FlashAttnBackend, why_not_flash
from kvserve.model_service.attention.select import torch_attention
from tests.model.test_attention import make_batch

WHY_NOT = why_not_flash()   # no CUDA, no flash-attn, or one that cannot page on this GPU
pytestmark = pytest.mark.skipif(WHY_NOT is not None, reason=WHY_NOT or "")

CASES = {
    "decodes only": ([1] * 6, [1, 130, 255, 256, 257, 700]),
    "one prompt, nothing cached": ([300], [300]),
    "chunks behind cached prefixes": ([64, 200], [320, 201]),
    "decodes and chunks": ([1, 1, 1, 90, 17], [40, 513, 129, 90, 400]),
}
# heads, KV heads, head dim: the bench models' group of 4 (each shape compiles flash-attn 4's kernels anew)
SHAPES = {"bench": (8, 2, 64), "1b": (32, 8, 64)}


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("page_size", [128, 256])
@pytest.mark.parametrize("case", CASES)
def test_flash_attn_equals_the_torch_backend(case: str, page_size: int, shape: str) -> None:
    flash = FlashAttnBackend()
    if page_size % flash.page_size_multiple():
        pytest.skip(f"flash-attn {flash.api.version} takes page sizes that are multiples of "
                    f"{flash.page_size_multiple()}")
    heads, kv_heads, head_dim = SHAPES[shape]
    query_lens, seq_lens = CASES[case]
    pages = sum(-(-n // page_size) for n in seq_lens) + 3
    num_decodes = next((i for i, n in enumerate(query_lens) if n != 1), len(query_lens))
    batch = make_batch(query_lens, seq_lens, num_decodes, page_size + heads, page_size, pages, "cuda")
    g = torch.Generator(device="cuda").manual_seed(7)
    t = sum(query_lens)

    def randn(*shape) -> torch.Tensor:
        return torch.randn(*shape, generator=g, device="cuda").to(torch.bfloat16)

    q, k, v = randn(t, heads, head_dim), randn(t, kv_heads, head_dim), randn(t, kv_heads, head_dim)
    k_pool, v_pool = randn(pages, page_size, kv_heads, head_dim), randn(pages, page_size, kv_heads, head_dim)
    scale = head_dim ** -0.5
    outs, pools = [], []
    for backend in (flash, torch_attention()):
        kc, vc = k_pool.clone(), v_pool.clone()
        outs.append(backend.forward(q, k, v, kc, vc, backend.prepare(batch), scale).float())
        pools.append((kc, vc))
    assert outs[0].shape == (t, heads, head_dim)
    assert torch.isfinite(outs[0]).all()
    torch.testing.assert_close(pools[0], pools[1], rtol=0, atol=0)   # the same slots written
    torch.testing.assert_close(outs[0], outs[1], rtol=2e-2, atol=2e-2)
