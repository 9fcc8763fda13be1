"""The native RoPE (kernels/rope.c) against the torch ops it replaces (model/rope.py)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve.model_service.kernels import rope
from kvserve.model_service.model.rope import apply_rope
from tests.model.native_kernels import load_or_skip


@pytest.fixture(scope="module")
def kernel() -> rope.RopeKernel:
    return load_or_skip(rope.load, "the native RoPE")


@settings(max_examples=60, deadline=None)
@given(rows=st.integers(1, 20), heads=st.integers(1, 6), half=st.integers(1, 40), extra=st.integers(0, 9),
       bf16=st.booleans(), seed=st.integers(0, 2**16))
def test_matches_the_torch_ops_on_a_view_of_wider_rows(kernel, rows, heads, half, extra, bf16, seed) -> None:
    """x as the model has it: the heads of a (T, width) matmul output, other columns after them;
    float32 to rounding, bfloat16 exactly (the same roundings), nothing outside x touched."""
    g = torch.Generator().manual_seed(seed)
    dtype = torch.bfloat16 if bf16 else torch.float32
    d = 2 * half
    wide = torch.randn(rows, heads * d + extra, generator=g).to(dtype)
    angles = torch.rand(rows, 1, half, generator=g) * 6
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    x = wide[:, :heads * d].view(rows, heads, d)
    want, rest = apply_rope(x.clone(), cos, sin), wide[:, heads * d:].clone()
    assert kernel.runs(x, cos)
    got = kernel(x, cos, sin)
    assert got.data_ptr() == x.data_ptr()
    if bf16:
        assert torch.equal(got, want)
    else:
        assert torch.allclose(got, want, rtol=1e-6, atol=1e-6)
    assert torch.equal(wide[:, heads * d:], rest)


def test_takes_only_what_it_can_read(kernel) -> None:
    cos = torch.ones(3, 1, 4)
    assert not kernel.runs(torch.randn(3, 2, 8).transpose(0, 1), torch.ones(2, 1, 4))   # heads apart
    assert not kernel.runs(torch.randn(3, 2, 7), cos)                                     # odd head size
    assert not kernel.runs(torch.randn(3, 2, 8).bfloat16(), cos)                          # dtypes differ
    assert not kernel.runs(torch.randn(4, 2, 8), cos)                                     # rows differ
    with pytest.raises(ValueError, match="rope"):
        kernel(torch.randn(3, 2, 7), cos, cos)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_prefill_chunk_split_between_threads_matches_too(kernel, dtype) -> None:
    """Rows enough for every thread (a prefill chunk): the same as the torch ops."""
    g = torch.Generator().manual_seed(1)
    rows, heads, d = 700, 4, 64
    wide = torch.randn(rows, heads * d + 32, generator=g).to(dtype)
    angles = torch.rand(rows, 1, d // 2, generator=g) * 6
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    x = wide[:, :heads * d].view(rows, heads, d)
    want = apply_rope(x.clone(), cos, sin)
    got = kernel(x, cos, sin)
    assert torch.equal(got, want) if dtype == torch.bfloat16 else torch.allclose(got, want, rtol=1e-6, atol=1e-6)
