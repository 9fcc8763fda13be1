"""oneDNN's CPU matmuls, through the ops torch's own compiler (inductor) emits for packed
linears: a weight is reordered once into oneDNN's layout, then each call is one matmul with
an optional element-wise op in its epilogue (bias, SiLU, a product, a residual add), so the
output is written once and never read back for the op.

The ops are private (torch.ops.mkldnn), so onednn_available() probes them once per dtype
against torch's own results before anything uses them. model/linear.py calls the same ops
inline, one call per matmul on the hot path.
"""

from __future__ import annotations

import functools
import logging

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)

def pack(weight: torch.Tensor) -> torch.Tensor:
    """W (N, K) in oneDNN's layout for linear()."""
    return torch.ops.mkldnn._reorder_linear_weight(weight, None)


def linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x Wᵀ + b."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def linear_silu(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """silu(x Wᵀ + b), SiLU in the epilogue."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "swish", [], "")


def linear_mul(x: torch.Tensor, other: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """(x Wᵀ + b) * other, the product in the epilogue."""
    return torch.ops.mkldnn._linear_pointwise.binary(x, other, packed, bias, "mul")


def linear_add(x: torch.Tensor, other: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """(x Wᵀ + b) + other, the add in the epilogue."""
    return torch.ops.mkldnn._linear_pointwise.binary(x, other, packed, bias, "add")


def linear_op(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, op: str = "none",
              other: torch.Tensor | None = None) -> torch.Tensor:
    """One of the four above by op ("none", "silu", "mul", "add"); the weight packed or plain."""
    if op == "silu":
        return linear_silu(x, weight, bias)
    if op == "mul":
        return linear_mul(x, other, weight, bias)
    if op == "add":
        return linear_add(x, other, weight, bias)
    return linear(x, weight, bias)


def matmul_nt(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a bᵀ with b a plain (unpacked) matrix: (M, K) x (N, K) -> (M, N). For operands that change
    every call (attention's keys and values); only where onednn_available(a.dtype)."""
    return torch.ops.mkldnn._linear_pointwise(a, b, None, "none", [], "")


@functools.cache
def native_bfloat16() -> bool:
    """Whether this CPU multiplies bfloat16 in hardware (AVX512-BF16 or AMX, as oneDNN sees it);
    elsewhere torch emulates bfloat16 matmuls, several times slower than float32 ones."""
    return torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()


@functools.cache
def onednn_available(dtype: torch.dtype) -> bool:
    """Whether the ops above run here in `dtype` (CPU) and agree with torch. The fused
    epilogues are probed in float32 only: the model fuses them in float32 only (model/linear.py)."""
    if dtype not in (torch.float32, torch.bfloat16) or not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.bfloat16 and not native_bfloat16():
        return False   # no native bf16 on this CPU: oneDNN would emulate it slowly
    try:
        g = torch.Generator().manual_seed(0)
        w, b = torch.randn(48, 64, generator=g).to(dtype), torch.randn(48, generator=g).to(dtype)
        x, other = torch.randn(5, 64, generator=g).to(dtype), torch.randn(5, 48, generator=g).to(dtype)
        ref = F.linear(x, w, b)
        packed = pack(w)
        pairs = [(linear(x, packed, b), ref), (matmul_nt(x, w), x @ w.T)]
        if dtype == torch.float32:
            pairs += [(linear_silu(x, packed, b), F.silu(ref)), (linear_mul(x, other, packed, b), ref * other),
                      (linear_add(x, other, packed, b), ref + other)]
        tol = 1e-4 if dtype == torch.float32 else 5e-2
        return all(torch.allclose(got.float(), want.float(), rtol=tol, atol=tol * 10) for got, want in pairs)
    except (RuntimeError, AttributeError, NotImplementedError) as exc:
        log.info("oneDNN linears unavailable (%s); using F.linear", exc)
        return False
