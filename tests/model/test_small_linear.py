"""The small-batch linear (kernels/small_linear.c) against a float64 reference, its refusals,
and the Linear path that uses it for calls of a few rows."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve.model_service.kernels import small_linear
from kvserve.model_service.model.linear import SMALL_ROWS, Linear
from tests.model.native_kernels import load_or_skip, torch_threads


@pytest.fixture(scope="module")
def kernel() -> small_linear.SmallLinear:
    return load_or_skip(small_linear.load, "the small-batch linear")


def reference(x, weight, bias, op, other) -> torch.Tensor:
    y = x.double() @ weight.double().T + (0 if bias is None else bias.double())
    return {"none": y, "silu": F.silu(y), "mul": y * (other.double() if other is not None else 1),
            "add": y + (other.double() if other is not None else 0)}[op]


@settings(max_examples=80, deadline=None)
@given(rows=st.integers(1, 20), n=st.integers(1, 70), k=st.integers(1, 300),
       op=st.sampled_from(["none", "silu", "mul", "add"]), bias=st.booleans(),
       bf16=st.booleans(), threads=st.integers(1, 2), seed=st.integers(0, 2**16))
def test_matches_a_float64_reference(kernel, rows, n, k, op, bias, bf16, threads, seed) -> None:
    """Ragged K (tails of the 32-, 16- and 8-wide loops), one row and 2-8 rows at once (and more,
    in groups of 8: the kernel takes any number, the model sends it at most SMALL_ROWS, or 32 bfloat16 ones), float32
    and bfloat16 weights (widened exactly: the reference multiplies the same bfloat16 values)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=g)
    w = torch.randn(n, k, generator=g)
    if bf16:
        w = w.bfloat16()
    b = torch.randn(n, generator=g) if bias else None
    other = torch.randn(rows, n, generator=g) if op in ("mul", "add") else None
    with torch_threads(threads):
        got = kernel(x, w, b, op, other)
    want = reference(x, w, b, op, other)
    assert got.dtype == torch.float32 and got.shape == (rows, n)
    scale = want.abs().max().item() + 1.0
    assert (got.double() - want).abs().max().item() <= 1e-6 * (k ** 0.5 + 1) * scale


def test_refuses_what_it_cannot_read(kernel) -> None:
    x, w = torch.randn(2, 16), torch.randn(8, 16)
    for args in [(x, torch.randn(8, 15)),                         # K differs
                 (x.double(), w),                                  # x not float32
                 (x, w.half()),                                    # weight neither float32 nor bfloat16
                 (x, w.t().contiguous().t()),                      # weight not contiguous
                 (x, w, torch.randn(7)),                           # bias the wrong size
                 (x, w, None, "mul"),                              # mul without the other operand
                 (x, w, None, "add", torch.randn(2, 7)),           # other the wrong shape
                 (x, w, None, "gelu")]:                            # no such op
        with pytest.raises(ValueError, match="small linear"):
            kernel(*args)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("gemm", ["torch", "onednn"])
def test_a_linear_runs_few_rows_on_it_and_many_on_its_gemm(kernel, dtype, gemm) -> None:
    """Up to SMALL_ROWS rows the small kernel (plain weight kept beside a packed one), more on the
    GEMM; both agree with F.linear, every fused op included. bfloat16 rounds the matmul once and
    runs the op after it in bfloat16, as F.linear followed by the op does."""
    from kvserve.model_service.kernels.onednn import onednn_available
    if gemm == "onednn" and not onednn_available(dtype):
        pytest.skip(f"oneDNN linears do not run here in {dtype}")
    g = torch.Generator().manual_seed(0)
    linear = Linear(96, 40, bias=True)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(40, 96, generator=g))
        linear.bias.copy_(torch.randn(40, generator=g))
    linear = linear.to(dtype)
    weight, bias = linear.weight.detach().clone(), linear.bias.detach().clone()
    linear.use_small(kernel)
    if gemm != "torch":
        linear.pack(gemm)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    for rows in (1, SMALL_ROWS, SMALL_ROWS + 1):
        x = torch.randn(rows, 96, generator=g).to(dtype)
        other = torch.randn(rows, 40, generator=g).to(dtype)
        y = F.linear(x, weight, bias)
        for got, want in [(linear(x), y), (linear.silu(x), F.silu(y)), (linear.mul(x, other), y * other),
                          (linear.add(x, other), y + other)]:
            assert got.dtype == dtype and got.shape == want.shape
            assert torch.allclose(got.float(), want.float(), rtol=tol, atol=tol), (rows, got, want)


def test_use_small_refuses_other_dtypes(kernel) -> None:
    with pytest.raises(ValueError, match="float32 and bfloat16"):
        Linear(8, 8).half().use_small(kernel)


@pytest.mark.parametrize("plain_on_onednn", [True, False])
def test_a_native_linear_runs_many_rows_on_its_plain_weight(kernel, plain_on_onednn) -> None:
    """The native GEMM packed beside the plain weight the small kernel keeps: calls of up to
    NATIVE_MAX_ROWS rows run on the native GEMM, more on the plain weight (through oneDNN where it
    runs, else F.linear), every fused op included, all agreeing with F.linear."""
    from kvserve.model_service.kernels import cpu_gemm
    from kvserve.model_service.kernels.onednn import onednn_available
    from kvserve.model_service.model.linear import NATIVE_MAX_ROWS
    load_or_skip(cpu_gemm.load, "the native GEMM")
    if plain_on_onednn and not onednn_available(torch.float32):
        pytest.skip("oneDNN linears do not run here")
    g = torch.Generator().manual_seed(1)
    linear = Linear(80, 48, bias=True)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(48, 80, generator=g) / 9)
        linear.bias.copy_(torch.randn(48, generator=g))
    weight, bias = linear.weight.detach().clone(), linear.bias.detach().clone()
    linear.use_small(kernel)
    linear.pack("native")
    linear._plain_on_onednn = plain_on_onednn
    native, calls = linear._native, []
    linear._native = lambda *args: calls.append(args[0].shape[0]) or native(*args)
    for rows in (SMALL_ROWS + 1, NATIVE_MAX_ROWS, NATIVE_MAX_ROWS + 1, 3 * NATIVE_MAX_ROWS):
        x = torch.randn(rows, 80, generator=g)
        other = torch.randn(rows, 48, generator=g)
        y = F.linear(x, weight, bias)
        for got, want in [(linear(x), y), (linear.silu(x), F.silu(y)), (linear.mul(x, other), y * other),
                          (linear.add(x, other), y + other)]:
            assert got.shape == want.shape
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert calls == [SMALL_ROWS + 1] * 4 + [NATIVE_MAX_ROWS] * 4
