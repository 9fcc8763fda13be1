"""Linear layers, with the fused forms the decoder needs, and packed GEMMs on CPU.

`Linear` is nn.Linear (same parameters, same state_dict names) plus three fused
calls: `silu(x)`, `mul(x, other)` and `add(x, other)`, i.e. the linear followed
by one element-wise op. Eagerly they are F.linear and then the op.

`Linear.pack(gemm)` moves the weight, once, at load time, into the layout of one
of two CPU GEMMs; from then on every call is one matmul whose op runs in its
epilogue, so the output is written once and never read back for the op:
- "native" (float32, AVX-512): model/cpu_gemm.c, weights in 32-column panels.
  Decode steps multiply few rows by weights far larger than the caches; it
  prefetches the next panel while it computes this one. Bench model, its 41
  matmuls, weights cold: 32 rows 6.8 ms against oneDNN's 8.8; 2048 rows on a
  par (docs/benchmarks.md).
- "onednn" (float32, bfloat16): torch.ops.mkldnn._linear_pointwise, the op
  torch's own compiler (inductor) emits for packed linears. It is private, so
  `onednn_available` probes it once.
Why not F.linear on CPU: torch's CPU matmul is MKL's, and on AMD EPYC MKL runs
its AVX2 code: on the 2-core dev VM (float32, the bench model's shapes,
GFLOP/s) at 2048 rows ~220 against oneDNN's ~510; at 32 rows 166-179 against
335-421. `choose_gemm` picks native, else onednn, else F.linear ("torch").
Results differ from F.linear's only in summation order (~1e-6 relative in float32).
"""

from __future__ import annotations

import functools
import logging

import torch
import torch.nn.functional as F
from torch import nn

from kvserve.model_service.model import cpu_gemm

log = logging.getLogger(__name__)

GEMMS = ("auto", "native", "onednn", "torch")


class Linear(nn.Linear):
    """y = x Wᵀ + b; after pack() through a CPU GEMM with W held packed instead of `weight`."""

    packed: torch.Tensor | cpu_gemm.PackedWeight | None = None   # the weight in the GEMM's layout, once packed
    gemm = "torch"                       # which GEMM runs it: torch (F.linear), native or onednn
    fused = False                        # ops in the GEMM epilogue (float32 only, see pack)

    def pack(self, gemm: str = "onednn") -> None:
        """Repacks the weight for `gemm` ("native" or "onednn") and drops the plain copy (a
        tied weight's other user keeps its own reference).

        Epilogues are fused in float32 only: they compute in float32 and round
        once, which in bfloat16 would skip the rounding transformers does after
        each op, and move logits by up to ~0.1 on the tiny test models."""
        weight = self.weight.detach()
        if gemm == "native":
            if weight.dtype != torch.float32:
                raise ValueError(f"the native CPU GEMM runs float32, not {weight.dtype}")
            self._native = cpu_gemm.load()
            packed = self._native.pack(weight, self.bias)   # checked once here, not per call
        elif gemm == "onednn":
            packed = torch.ops.mkldnn._reorder_linear_weight(weight, None)
        else:
            raise ValueError(f"cannot pack for {gemm!r}: native or onednn")
        self.fused = weight.dtype == torch.float32
        del self.weight                       # the Parameter: packed replaces it
        self.packed, self.gemm = packed, gemm

    def forward(self, x: torch.Tensor) -> torch.Tensor:     # (..., in) -> (..., out)
        if self.gemm == "native":
            return self._native(x, self.packed)
        if self.gemm == "onednn":
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)

    def silu(self, x: torch.Tensor) -> torch.Tensor:
        """silu(x Wᵀ + b)."""
        if self.gemm == "native":
            return self._native(x, self.packed, "silu")
        if self.fused:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "swish", [], "")
        return F.silu(self(x))

    def mul(self, x: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
        """(x Wᵀ + b) * other; other has the output's shape."""
        if self.gemm == "native":
            return self._native(x, self.packed, "mul", other)
        if self.fused:
            return torch.ops.mkldnn._linear_pointwise.binary(x, other, self.packed, self.bias, "mul")
        return self(x) * other

    def add(self, x: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
        """(x Wᵀ + b) + other (a residual); other has the output's shape."""
        if self.gemm == "native":
            return self._native(x, self.packed, "add", other)
        if self.fused:
            return torch.ops.mkldnn._linear_pointwise.binary(x, other, self.packed, self.bias, "add")
        return self(x) + other


def choose_gemm(name: str, dtype: torch.dtype, device: torch.device) -> str:
    """--cpu-gemm NAME -> the GEMM the linears run: "auto" takes native, else onednn, else torch;
    a named one that cannot run here raises ValueError saying why. Off CPU: torch."""
    if name not in GEMMS:
        raise ValueError(f"unknown GEMM {name!r}: one of {', '.join(GEMMS)}")
    if device.type != "cpu" or name == "torch":
        if name not in ("auto", "torch"):
            raise ValueError(f"the {name} GEMM runs on CPU, not {device}")
        return "torch"
    if name in ("auto", "native"):
        if dtype != torch.float32:
            if name == "native":
                raise ValueError(f"the native CPU GEMM cannot run here: it runs float32, not {dtype}")
        else:
            try:
                cpu_gemm.load()
                return "native"
            except cpu_gemm.KernelUnavailable as exc:
                if name == "native":
                    raise ValueError(f"the native CPU GEMM cannot run here: {exc}") from None
                log.warning("the native CPU GEMM is unavailable (%s); matmuls go to oneDNN or F.linear", exc)
    if onednn_available(dtype):
        return "onednn"
    if name == "onednn":
        raise ValueError(f"oneDNN linears do not run here in {dtype}")
    return "torch"


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
