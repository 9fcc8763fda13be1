"""Linear layers, with the fused forms the decoder needs, and oneDNN on CPU.

`Linear` is nn.Linear (same parameters, same state_dict names) plus three fused
calls: `silu(x)`, `mul(x, other)` and `add(x, other)`, i.e. the linear followed
by one element-wise op. Eagerly they are F.linear and then the op.

`Linear.pack()` moves the weight into oneDNN's blocked layout, once, at load
time. From then on every call is one oneDNN matmul whose op runs in the GEMM's
epilogue, so the output is written once and never read back for the op.
Why not F.linear on CPU: torch's CPU matmul is MKL's, and on AMD EPYC MKL runs
its AVX2 code while oneDNN JITs AVX-512. `bench/model_bench.py` on the 2-core
dev VM (float32, the bench model's shapes, GFLOP/s): at 2048 rows ~220 vs ~510;
at 32 rows (decode) 166-179 vs 335-421; the LM head at 32 rows 117 vs 379
(docs/benchmarks.md). Results differ from F.linear's only in summation order
(~1e-6 relative in float32).

torch.ops.mkldnn._linear_pointwise is the op torch's own compiler (inductor)
emits for packed linears; it is private, so `onednn_available` probes it once
and everything falls back to F.linear where it is missing or misbehaves.
"""

from __future__ import annotations

import functools
import logging

import torch
import torch.nn.functional as F
from torch import nn

log = logging.getLogger(__name__)


class Linear(nn.Linear):
    """y = x Wᵀ + b; after pack() through oneDNN with W held packed instead of `weight`."""

    packed: torch.Tensor | None = None   # oneDNN's layout of weight, once packed
    fused = False                        # ops in the GEMM epilogue (float32 only, see pack)

    def pack(self) -> None:
        """Repacks the weight for oneDNN and drops the plain copy (a tied weight's
        other user keeps its own reference).

        Epilogues are fused in float32 only: they compute in float32 and round
        once, which in bfloat16 would skip the rounding transformers does after
        each op, and move logits by up to ~0.1 on the tiny test models."""
        packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach(), None)
        self.fused = self.weight.dtype == torch.float32
        del self.weight                       # the Parameter: packed replaces it
        self.packed = packed

    def forward(self, x: torch.Tensor) -> torch.Tensor:     # (..., in) -> (..., out)
        if self.packed is None:
            return F.linear(x, self.weight, self.bias)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")

    def silu(self, x: torch.Tensor) -> torch.Tensor:
        """silu(x Wᵀ + b)."""
        if self.fused:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "swish", [], "")
        return F.silu(self(x))

    def mul(self, x: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
        """(x Wᵀ + b) * other; other has the output's shape."""
        if self.fused:
            return torch.ops.mkldnn._linear_pointwise.binary(x, other, self.packed, self.bias, "mul")
        return self(x) * other

    def add(self, x: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
        """(x Wᵀ + b) + other (a residual); other has the output's shape."""
        if self.fused:
            return torch.ops.mkldnn._linear_pointwise.binary(x, other, self.packed, self.bias, "add")
        return self(x) + other


def matmul_nt(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a bᵀ through oneDNN, b a plain (unpacked) matrix: (M, K) x (N, K) -> (M, N).
    For operands that change every call (attention's keys and values); only where
    onednn_available(a.dtype)."""
    return torch.ops.mkldnn._linear_pointwise(a, b, None, "none", [], "")


@functools.cache
def onednn_available(dtype: torch.dtype) -> bool:
    """Whether oneDNN linears (packed, and matmul_nt) run here in `dtype` (CPU) and agree with torch."""
    if dtype not in (torch.float32, torch.bfloat16) or not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.bfloat16 and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return False   # no native bf16 on this CPU: oneDNN would emulate it slowly
    try:
        g = torch.Generator().manual_seed(0)
        probe = Linear(64, 48, bias=True, dtype=dtype)
        with torch.no_grad():
            probe.weight.copy_(torch.randn(48, 64, generator=g))
            probe.bias.copy_(torch.randn(48, generator=g))
        x, other = torch.randn(5, 64, generator=g).to(dtype), torch.randn(5, 48, generator=g).to(dtype)
        weight = probe.weight.detach()
        expected = [probe(x), probe.silu(x), probe.mul(x, other), probe.add(x, other), x @ weight.T]
        product = matmul_nt(x, weight)
        probe.pack()
        got = [probe(x), probe.silu(x), probe.mul(x, other), probe.add(x, other), product]
        tol = 1e-4 if dtype == torch.float32 else 5e-2
        return all(torch.allclose(a.float(), b.float(), rtol=tol, atol=tol * 10) for a, b in zip(got, expected))
    except (RuntimeError, AttributeError, NotImplementedError) as exc:
        log.info("oneDNN linears unavailable (%s); using F.linear", exc)
        return False
