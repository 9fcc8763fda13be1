"""Linear's fused forms, eager and packed for each CPU GEMM; packed models against unpacked ones."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvserve.model_service.kernels import cpu_gemm
from kvserve.model_service.model.layers import GatedMLP
from kvserve.model_service.kernels.gemm import choose_gemm
from kvserve.model_service.kernels.onednn import matmul_nt, onednn_available
from kvserve.model_service.model.linear import Linear
from kvserve.model_service.model.loader import load_model
from tests.model.native_kernels import why_not
from tests.model.test_loader import prompt_logits

needs_onednn = pytest.mark.skipif(not onednn_available(torch.float32), reason="oneDNN linears do not run here")


# Each packed GEMM, skipped where it cannot run.
GEMMS = [pytest.param("native", marks=pytest.mark.skipif(why_not(cpu_gemm.load) is not None,
                                                          reason=f"no native GEMM here: {why_not(cpu_gemm.load)}")),
         pytest.param("onednn", marks=needs_onednn)]


def random_linear(n_in: int, n_out: int, bias: bool, dtype=torch.float32, seed: int = 0) -> Linear:
    g = torch.Generator().manual_seed(seed)
    linear = Linear(n_in, n_out, bias=bias, dtype=dtype)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(n_out, n_in, generator=g) / n_in ** 0.5)
        if bias:
            linear.bias.copy_(torch.randn(n_out, generator=g))
    return linear


def all_forms(linear: Linear, x: torch.Tensor, other: torch.Tensor) -> list[torch.Tensor]:
    return [linear(x), linear.silu(x), linear.mul(x, other), linear.add(x, other)]


@pytest.mark.parametrize("bias", [False, True])
def test_eager_forms_are_the_linear_then_the_op(bias: bool) -> None:
    linear = random_linear(24, 40, bias)
    x, other = torch.randn(7, 24), torch.randn(7, 40)
    y = F.linear(x, linear.weight, linear.bias)
    expected = [y, F.silu(y), y * other, y + other]
    for got, want in zip(all_forms(linear, x, other), expected, strict=True):
        assert torch.equal(got, want)


@pytest.mark.parametrize("gemm", GEMMS)
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 5, 33, 300])
def test_packed_forms_match_eager(gemm: str, bias: bool, rows: int) -> None:
    linear = random_linear(64, 96, bias)
    x, other = torch.randn(rows, 64), torch.randn(rows, 96)
    expected = all_forms(linear, x, other)
    linear.pack(gemm)
    assert linear.fused and linear.gemm == gemm and "weight" not in dict(linear.named_parameters())
    for got, want in zip(all_forms(linear, x, other), expected, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("gemm", GEMMS)
def test_packed_linear_takes_strided_and_batched_inputs(gemm: str) -> None:
    linear = random_linear(32, 16, bias=True)
    wide = torch.randn(6, 64)[:, ::2]                 # (6, 32), not contiguous
    batched = torch.randn(2, 3, 32)
    expected = linear(wide), linear(batched)
    linear.pack(gemm)
    torch.testing.assert_close(linear(wide), expected[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(linear(batched), expected[1], rtol=1e-5, atol=1e-5)


@needs_onednn
@pytest.mark.parametrize("rows, cols, inner", [(320, 624, 64), (5, 3, 7), (320, 64, 624)])
def test_matmul_nt_is_a_times_b_transposed(rows: int, cols: int, inner: int) -> None:
    g = torch.Generator().manual_seed(3)
    a, b = torch.randn(rows, inner, generator=g), torch.randn(cols, inner, generator=g)
    torch.testing.assert_close(matmul_nt(a, b), a @ b.T, rtol=1e-5, atol=1e-4)


@pytest.mark.skipif(not onednn_available(torch.bfloat16), reason="no native bfloat16 oneDNN here")
def test_bfloat16_packs_without_fusing_so_it_rounds_like_eager() -> None:
    linear = random_linear(64, 96, bias=False, dtype=torch.bfloat16)
    x, other = torch.randn(9, 64).bfloat16(), torch.randn(9, 96).bfloat16()
    plain = linear(x)
    linear.pack("onednn")
    assert not linear.fused
    torch.testing.assert_close(linear.silu(x), F.silu(linear(x)), rtol=0, atol=0)
    torch.testing.assert_close(linear.mul(x, other), linear(x) * other, rtol=0, atol=0)
    torch.testing.assert_close(linear.add(x, other), linear(x) + other, rtol=0, atol=0)
    torch.testing.assert_close(linear(x).float(), plain.float(), rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("gemm", GEMMS)
def test_packed_mlp_splits_gate_and_up_and_matches(gemm: str) -> None:
    torch.manual_seed(0)
    mlp = GatedMLP(32, 48)
    with torch.no_grad():
        for p in mlp.parameters():
            p.normal_(0, 0.2)
    x, residual = torch.randn(11, 32), torch.randn(11, 32)
    expected = mlp(x, residual)
    mlp.pack(gemm)
    assert mlp.gate_up_proj is None and mlp.gate_proj.gemm == mlp.up_proj.gemm == gemm
    torch.testing.assert_close(mlp(x, residual), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("gemm", GEMMS)
@pytest.mark.parametrize("name", ["tiny", "tiny-qwen2", "tiny-qwen3"])
def test_load_packs_on_cpu_and_the_logits_stay(tiny_dirs, backend, gemm: str, name: str) -> None:
    packed, config = load_model(tiny_dirs[name], gemm=gemm)
    plain, _ = load_model(tiny_dirs[name], gemm="torch")
    assert packed.lm_head.gemm == gemm and plain.lm_head.gemm == "torch" and plain.lm_head.packed is None
    if config.tie_word_embeddings:   # packing the head must leave the embedding whole
        torch.testing.assert_close(packed.embed_tokens.weight, plain.embed_tokens.weight, rtol=0, atol=0)
    tokens = list(range(5, 45))
    torch.testing.assert_close(prompt_logits(packed, config, backend, tokens),
                               prompt_logits(plain, config, backend, tokens), rtol=1e-4, atol=1e-4)


def test_a_gemm_that_cannot_run_is_refused_before_loading(tiny_dirs) -> None:
    with pytest.raises(ValueError, match="oneDNN linears do not run here in torch.float16"):
        load_model(tiny_dirs["tiny"], "float16", gemm="onednn")
    with pytest.raises(ValueError, match="native CPU GEMM cannot run here: it runs float32, not torch.bfloat16"):
        load_model(tiny_dirs["tiny"], "bfloat16", gemm="native")
    with pytest.raises(ValueError, match="runs on CPU, not meta"):
        choose_gemm("onednn", torch.float32, torch.device("meta"))
    with pytest.raises(ValueError, match="unknown GEMM 'mkl'"):
        choose_gemm("mkl", torch.float32, torch.device("cpu"))


def test_auto_takes_native_then_onednn_then_torch(monkeypatch) -> None:
    """The measured order (kernels/gemm.py, docs/benchmarks.md): the native GEMM where it runs
    (its prefill-sized calls on the plain weight), else oneDNN, else F.linear; without the plain
    weights kept, oneDNN first."""
    from kvserve.model_service.kernels import gemm

    cpu = torch.device("cpu")
    native = why_not(cpu_gemm.load) is None
    dnn = onednn_available(torch.float32)
    assert choose_gemm("auto", torch.float32, cpu) == ("native" if native else "onednn" if dnn else "torch")
    assert choose_gemm("auto", torch.float32, cpu, plain_kept=False) == (
        "onednn" if dnn else "native" if native else "torch")
    assert choose_gemm("auto", torch.float16, cpu) == "torch"          # neither packs float16
    assert choose_gemm("auto", torch.float32, torch.device("meta")) == "torch"
    if onednn_available(torch.bfloat16):                                # native runs float32 only
        assert choose_gemm("auto", torch.bfloat16, cpu) == "onednn"

    monkeypatch.setattr(gemm, "onednn_available", lambda dtype: False)
    assert choose_gemm("auto", torch.float32, cpu) == ("native" if native else "torch")
    assert choose_gemm("auto", torch.float32, cpu, plain_kept=False) == ("native" if native else "torch")

    def unavailable():
        raise cpu_gemm.KernelUnavailable("the cpu_gemm kernel was not built for this CPU")

    monkeypatch.setattr(cpu_gemm, "load", unavailable)
    assert choose_gemm("auto", torch.float32, cpu) == "torch"
    with pytest.raises(ValueError, match="native CPU GEMM cannot run here: the cpu_gemm kernel was not built"):
        choose_gemm("native", torch.float32, cpu)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 7, 8, 40])
def test_widened_bfloat16_is_the_float32_matmul_rounded_once(monkeypatch, bias: bool, rows: int) -> None:
    """From WIDEN_MIN_ROWS rows a widened linear is the float32 matmul of the bfloat16 values,
    rounded once (whole, or block by block, as here with blocks of 7 outputs, where the float32
    sums may take another order: within one bfloat16 rounding); fewer rows stay on F.linear; the
    fused forms take their op after the rounding, as unwidened ones do."""
    from kvserve.model_service.model import linear as linear_module

    linear = random_linear(64, 96, bias, dtype=torch.bfloat16)
    gen = torch.Generator().manual_seed(rows)
    x, other = torch.randn(rows, 64, generator=gen).bfloat16(), torch.randn(rows, 96, generator=gen).bfloat16()
    eager = all_forms(linear, x, other)
    linear.widen_bfloat16()
    assert linear.widen_min_rows == linear_module.WIDEN_MIN_ROWS == 8
    exact = F.linear(x.float(), linear.weight.float(), None if linear.bias is None else linear.bias.float())
    for block_floats, rtol in ((linear_module.WIDEN_BLOCK_FLOATS, 0.0), (7 * 64, 2 ** -7)):
        monkeypatch.setattr(linear_module, "WIDEN_BLOCK_FLOATS", block_floats)
        got = all_forms(linear, x, other)
        if rows < 8:
            for g, want in zip(got, eager, strict=True):
                assert torch.equal(g, want)
            continue
        y = got[0]
        assert y.dtype == torch.bfloat16
        torch.testing.assert_close(y.float(), exact.bfloat16().float(), rtol=rtol, atol=0)
        for g, want in zip(got[1:], [F.silu(y), y * other, y + other], strict=True):
            assert torch.equal(g, want)
        torch.testing.assert_close(y, eager[0], rtol=1e-2, atol=1e-2)   # torch's emulation: its own rounding


@pytest.mark.parametrize("rows", [4, 5, 32, 33])
def test_widened_bfloat16_sends_up_to_32_rows_to_the_small_batch_kernel(rows: int) -> None:
    """With the small-batch kernel bound, a widened linear's calls of up to WIDEN_SMALL_ROWS rows
    run there (the weight widened in registers, float32 sums, one rounding), more rows widened."""
    from kvserve.model_service.kernels import small_linear
    from kvserve.model_service.model import linear as linear_module
    from tests.model.native_kernels import load_or_skip

    kernel = load_or_skip(small_linear.load, "the small-batch linear")
    linear = random_linear(64, 96, True, dtype=torch.bfloat16)
    linear.use_small(kernel)
    linear.widen_bfloat16()
    assert linear.small_rows == linear_module.WIDEN_SMALL_ROWS == 32
    gen = torch.Generator().manual_seed(rows)
    x, other = torch.randn(rows, 64, generator=gen).bfloat16(), torch.randn(rows, 96, generator=gen).bfloat16()
    calls = {"small": 0, "widened": 0}
    plain, widened = linear.plain, linear._widened

    def counted(name, fn):
        def call(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)
        return call

    linear.plain, linear._widened = counted("small", plain), counted("widened", widened)
    got = all_forms(linear, x, other)
    assert calls == ({"small": 4, "widened": 0} if rows <= 32 else {"small": 0, "widened": 4})
    y = got[0]
    assert torch.equal(y, plain(x.float()).bfloat16() if rows <= 32 else widened(x))
    for g, want in zip(got[1:], [F.silu(y), y * other, y + other], strict=True):
        assert torch.equal(g, want)
    exact = F.linear(x.float(), linear.weight.float(), linear.bias.float()).bfloat16().float()
    torch.testing.assert_close(y.float(), exact, rtol=2 ** -7, atol=1e-6)


def test_the_onednn_probe_runs_once_per_dtype() -> None:
    """It packs and runs a matmul: the attention asks it every step (attention/chunks.py)."""
    from kvserve.model_service.kernels import onednn

    onednn.onednn_available(torch.float32)
    before = onednn.onednn_available.cache_info()
    onednn.onednn_available(torch.float32)
    assert onednn.onednn_available.cache_info().hits == before.hits + 1


def test_only_a_bfloat16_weight_on_f_linear_widens() -> None:
    with pytest.raises(ValueError, match="only a bfloat16 weight on F.linear"):
        random_linear(8, 8, False).widen_bfloat16()


def test_bfloat16_loads_widened_where_the_cpu_has_no_bfloat16_matmuls(tiny_dirs, monkeypatch) -> None:
    """On F.linear, a CPU without bfloat16 matmuls widens every linear's prefill; one with them,
    or float32, does not."""
    from kvserve.model_service.kernels import gemm as gemm_module

    for native, dtype, widened in ((False, "bfloat16", True), (True, "bfloat16", False), (False, "float32", False)):
        monkeypatch.setattr(gemm_module, "native_bfloat16", lambda native=native: native)
        model, _ = load_model(tiny_dirs["tiny"], dtype, gemm="torch")
        assert {linear.widen_min_rows is not None for linear in model.linears()} == {widened}
