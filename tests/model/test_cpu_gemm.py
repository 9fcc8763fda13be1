"""The native float32 GEMM (kernels/cpu_gemm.c) against a float64 reference, and its refusals."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve.model_service.kernels import cpu_gemm
from tests.model.native_kernels import load_or_skip


@pytest.fixture(scope="module")
def gemm() -> cpu_gemm.CpuGemm:
    return load_or_skip(cpu_gemm.load, "the native GEMM")


def reference(x, weight, bias, op, other) -> torch.Tensor:
    y = x.double() @ weight.double().T + (0 if bias is None else bias.double())
    return {"none": y, "silu": F.silu(y), "mul": y * (other.double() if other is not None else 1),
            "add": y + (other.double() if other is not None else 0)}[op]


def assert_matches(got: torch.Tensor, want: torch.Tensor, k: int) -> None:
    assert got.dtype == torch.float32 and got.shape == want.shape
    # float32 sums of k products: error grows like sqrt(k) times the terms' size
    scale = want.abs().max().item() + 1.0
    assert (got.double() - want).abs().max().item() <= 1e-6 * (k ** 0.5 + 1) * scale


@settings(max_examples=60, deadline=None)
@given(rows=st.integers(1, 140), n=st.integers(1, 100), k=st.integers(1, 300),
       op=st.sampled_from(["none", "silu", "mul", "add"]), bias=st.booleans(),
       pad=st.integers(0, 5), threads=st.integers(1, 2), seed=st.integers(0, 2**16))
def test_matches_a_float64_reference(gemm, rows, n, k, op, bias, pad, threads, seed) -> None:
    """Rows beyond one 8-row tile (and, when drawn above 128, one block), columns beyond one
    32-column panel, ragged everywhere; x's rows may be further apart than K (a view of a wider
    tensor)."""
    g = torch.Generator().manual_seed(seed)
    weight = torch.randn(n, k, generator=g)
    b = torch.randn(n, generator=g) if bias else None
    x = torch.randn(rows, k + pad, generator=g)[:, :k]
    other = torch.randn(rows, n, generator=g) if op in ("mul", "add") else None
    packed = gemm.pack(weight, b)
    assert packed.panels.shape == (-(-n // cpu_gemm.PANEL), k, cpu_gemm.PANEL) and (packed.n, packed.k) == (n, k)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = gemm(x, packed, op, other)
    finally:
        torch.set_num_threads(previous)
    assert_matches(got, reference(x, weight, b, op, other), k)


@pytest.mark.parametrize("n", [1, 15, 16, 17, 31, 32, 33, 47, 48, 49, 64, 95, 96, 97])
@pytest.mark.parametrize("op", ["none", "silu", "mul"])
def test_every_width_of_the_last_panel(gemm, n: int, op: str) -> None:
    """A panel's 48 columns are three 16-float vectors: a last panel of any width, one to all
    three partly filled or empty, reads and writes only its own columns (the output's neighbours
    in a wider buffer stay untouched), with the epilogue on each."""
    g = torch.Generator().manual_seed(n)
    weight, b = torch.randn(n, 40, generator=g), torch.randn(n, generator=g)
    x, other = torch.randn(11, 40, generator=g), torch.randn(11, n, generator=g)
    other = other if op == "mul" else None
    assert_matches(gemm(x, gemm.pack(weight, b), op, other), reference(x, weight, b, op, other), 40)
    wide = torch.full((11, n + 5), 7.0)   # rows ldy apart, past the last column
    packed = gemm.pack(weight, b)
    out = gemm(x, packed)
    gemm._gemm(x.data_ptr(), 40, packed.panels.data_ptr(), b.data_ptr(), wide.data_ptr(), n + 5, 11, n, 40, 0,
               None, 0, 1)
    torch.testing.assert_close(wide[:, :n], out)
    assert (wide[:, n:] == 7.0).all()


@pytest.mark.parametrize("k", [2049, 3001])
@pytest.mark.parametrize("op", ["none", "silu", "add"])
@pytest.mark.parametrize("rows", [5, 13, 140])
def test_long_k_is_summed_in_chunks_with_one_epilogue(gemm, k: int, op: str, rows: int) -> None:
    """K beyond 2048 runs in chunks once there is more than one 8-row tile (13, 140 rows: one
    and two blocks), each resuming the sums the last one stored; the bias and the op come once,
    after the last. A lone tile (5 rows) takes the whole K at once."""
    g = torch.Generator().manual_seed(k)
    weight, b = torch.randn(70, k, generator=g), torch.randn(70, generator=g)
    x, other = torch.randn(rows, k, generator=g), torch.randn(rows, 70, generator=g)
    other = other if op == "add" else None
    assert_matches(gemm(x, gemm.pack(weight, b), op, other), reference(x, weight, b, op, other), k)


@pytest.mark.parametrize("n, k", [(640, 64), (70, 33), (5, 3)])
def test_packs_from_strided_rows_and_from_the_transpose(gemm, n: int, k: int) -> None:
    """Attention's products: keys packed straight from a view whose rows are further apart
    than K (heads interleaved), and Vᵀ packed from V's rows."""
    g = torch.Generator().manual_seed(n)
    interleaved = torch.randn(n, 2, k, generator=g)            # (S, heads, D), as gathered pages
    keys, x = interleaved[:, 1], torch.randn(9, k, generator=g)
    assert keys.stride(0) == 2 * k
    assert_matches(gemm(x, gemm.pack(keys)), reference(x, keys, None, "none", None), k)
    values, probs = interleaved[:, 0], torch.randn(9, n, generator=g)   # P (rows, S) V (S, D)
    assert_matches(gemm(probs, gemm.pack_transposed(values)), probs.double() @ values.double(), n)


@pytest.mark.parametrize("rows", [129, 200, 300])
def test_rows_in_several_blocks(gemm, rows: int) -> None:
    g = torch.Generator().manual_seed(rows)
    weight, b, x = torch.randn(72, 48, generator=g), torch.randn(72, generator=g), torch.randn(rows, 48, generator=g)
    other = torch.randn(rows, 72, generator=g)
    assert_matches(gemm(x, gemm.pack(weight, b), "mul", other), reference(x, weight, b, "mul", other), 48)


def test_leading_dims_and_no_rows(gemm) -> None:
    weight, x = torch.randn(40, 24), torch.randn(2, 3, 24)
    packed = gemm.pack(weight)
    assert_matches(gemm(x, packed), reference(x, weight, None, "none", None), 24)
    assert gemm(torch.empty(0, 24), packed).shape == (0, 40)


def test_silu_of_large_negative_values_is_finite(gemm) -> None:
    """-ffast-math assumes no infinities: expf(300) must not become inf and then NaN. 40 columns:
    the epilogue's vector loop, not only its scalar tail."""
    weight = torch.full((40, 1), 1.0)
    x = torch.tensor([[-1e30], [-300.0], [-88.5], [-50.0], [30.0]])
    got = gemm(x, gemm.pack(weight), op="silu")
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, F.silu(x @ weight.T), rtol=1e-6, atol=1e-30)


def test_inconsistent_calls_are_refused(gemm) -> None:
    packed = gemm.pack(torch.randn(40, 24))
    x = torch.randn(3, 24)
    bad = [
        lambda: gemm(torch.randn(3, 23), packed),                           # K differs
        lambda: gemm(x.double(), packed),
        lambda: gemm(x.to("meta"), packed),
        lambda: gemm(x, packed, op="gelu"),                                 # no such op
        lambda: gemm(x, packed, op="mul"),                                  # mul without other
        lambda: gemm(x, packed, op="add", other=torch.randn(3, 39)),
        lambda: gemm(x, packed, op="add", other=torch.randn(3, 40, device="meta")),
        lambda: gemm(x, packed, other=torch.randn(3, 40)),                  # other without an op for it
        lambda: gemm.pack(torch.randn(40, 24), torch.randn(39)),            # bias length
        lambda: gemm.pack(torch.randn(40, 24), torch.randn(40, device="meta")),   # bias off the CPU
        lambda: gemm.pack(torch.randn(40, 24), torch.randn(40).double()),
        lambda: gemm.pack(torch.randn(4, 4, 4)),
        lambda: gemm.pack(torch.randn(4, 4).bfloat16()),
        lambda: gemm.pack_transposed(torch.randn(4)),
    ]
    for call in bad:
        with pytest.raises(ValueError):
            call()
