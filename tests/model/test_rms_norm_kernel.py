"""The native RMSNorm (kernels/rms_norm.c) against the torch ops it replaces (model/layers.py)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve.model_service.kernels import rms_norm
from kvserve.model_service.model.layers import RMSNorm
from tests.model.native_kernels import load_or_skip, torch_threads


@pytest.fixture(scope="module")
def kernel() -> rms_norm.RmsNormKernel:
    return load_or_skip(rms_norm.load, "the native RMSNorm")


def torch_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    norm = RMSNorm(weight.shape[0], eps).to(weight.dtype)
    with torch.no_grad():
        norm.weight.copy_(weight)
    return norm(x)   # no kernel given: the torch ops


@settings(max_examples=60, deadline=None)
@given(rows=st.integers(1, 40), n=st.integers(1, 200), bf16=st.booleans(), threads=st.integers(1, 2),
       seed=st.integers(0, 2**16))
def test_matches_the_torch_ops(kernel, rows, n, bf16, threads, seed) -> None:
    """float32: to rounding (the sum's order differs); bfloat16: every value within one bfloat16
    step of torch's, the roundings after the normalisation and after the weight kept."""
    g = torch.Generator().manual_seed(seed)
    dtype = torch.bfloat16 if bf16 else torch.float32
    x = (torch.randn(rows, n, generator=g) * 3).to(dtype)
    weight = torch.randn(n, generator=g).to(dtype)
    with torch_threads(threads):
        got = kernel(x, weight, 1e-6)
    want = torch_norm(x, weight, 1e-6)
    assert got.dtype == dtype and got.shape == want.shape
    if bf16:
        step = want.float().abs().clamp_min(1e-3) * 2 ** -7
        assert ((got.float() - want.float()).abs() <= step).all()
    else:
        assert torch.allclose(got, want, rtol=1e-5, atol=1e-6)


def test_takes_only_what_it_can_read(kernel) -> None:
    w = torch.ones(8)
    assert kernel.runs(torch.randn(3, 8), w)
    assert kernel.runs(torch.randn(2, 3, 8), w)                      # any leading dims
    assert not kernel.runs(torch.randn(8, 3).t(), w)                 # not contiguous
    assert not kernel.runs(torch.randn(3, 8).double(), w.double())   # float64
    assert not kernel.runs(torch.randn(3, 8).bfloat16(), w)          # dtypes differ
    assert not kernel.runs(torch.randn(3, 7), w)                     # sizes differ
    assert not kernel.runs(torch.randn(3, 8), torch.ones(8, 2))      # a 2-D weight: its first row was read
    assert not kernel.runs(torch.randn(3, 0), torch.ones(0))         # nothing to normalise: it divided by 0
    with pytest.raises(ValueError, match="rms norm"):
        kernel(torch.randn(3, 7), w, 1e-6)


def test_the_module_uses_it_where_it_runs(kernel) -> None:
    norm = RMSNorm(16, 1e-5)
    norm.use_kernel(kernel)
    x = torch.randn(4, 2, 16)
    assert torch.allclose(norm(x), torch_norm(x, norm.weight.detach(), 1e-5), rtol=1e-5, atol=1e-6)
    view = torch.randn(4, 32)[:, :16]                                 # not contiguous: the torch ops
    assert torch.allclose(norm(view), torch_norm(view, norm.weight.detach(), 1e-5))
