"""Linear layers, with the fused forms the decoder needs, and packed GEMMs on CPU.

`Linear` is nn.Linear (same parameters, same state_dict names) plus three fused
calls: `silu(x)`, `mul(x, other)` and `add(x, other)`, i.e. the linear followed
by one element-wise op. Eagerly they are F.linear and then the op.

`Linear.pack(gemm)` moves the weight, once, at load time, into the layout of one
of two CPU GEMMs (kernels/gemm.py says which runs where, and why); from then on every
call is one matmul whose op runs in its epilogue, so the output is written once and
never read back for the op:
- "native" (float32, AVX-512): kernels/cpu_gemm.c, weights in 48-column panels, the next
  panel prefetched while this one is computed (decode steps multiply few rows by weights
  far larger than the caches).
- "onednn" (float32, bfloat16): oneDNN's packed linears, called here directly (one call per
  matmul on the hot path); kernels/onednn.py packs the weights and probes the ops.
Results differ from F.linear's only in summation order (~1e-6 relative in float32).

`Linear.widen_bfloat16()` is for bfloat16 weights left to F.linear on a CPU without bfloat16
matmul instructions (no AVX512-BF16 or AMX), where torch emulates them several times slower
than float32: calls of at least WIDEN_MIN_ROWS rows (a prefill) widen the weight, a block of it
at a time, and run in float32, the output rounded once to bfloat16, as a bfloat16 matmul with
float32 sums does; fewer rows stay on F.linear, the widening costing more than it saves there.
And the small-batch kernel, which widens the weight in registers as it streams it, takes such
calls up to WIDEN_SMALL_ROWS rows (a decode step of many sequences), where it beats both
(docs/benchmarks.md, "AVX2: ... bfloat16 without bfloat16 matmuls").

`Linear.use_small(kernel)` adds a path for calls with at most SMALL_ROWS rows (a decode step of
a few sequences; WIDEN_SMALL_ROWS under widen_bfloat16): kernels/small_linear.c reads the plain weight (float32 or bfloat16) as one
stream per thread, which at one row runs near the memory bandwidth where the packed GEMMs reach
about half of it (docs/benchmarks.md, "Single stream"). A packed linear keeps its plain weight
beside the packed one for it.

The native GEMM leads oneDNN from a few rows to about a hundred (a decode step's batch) and
falls behind it at prefill sizes (docs/benchmarks.md, "The native GEMM by rows, on Ice Lake").
So a natively packed linear that kept its plain weight runs calls of more than NATIVE_MAX_ROWS
rows on that plain weight: through oneDNN's ops, which take a plain weight too (within a few
per cent of a packed one's speed there, with the same fused epilogues), or F.linear where
oneDNN does not run. Nothing is packed twice.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvserve.model_service.kernels import cpu_gemm, onednn
from kvserve.model_service.kernels.small_linear import SMALL_ROWS, BoundWeight, SmallLinear

NATIVE_MAX_ROWS = 128   # a native linear's calls with more rows run on its plain weight (above)
WIDEN_MIN_ROWS = 8      # widen_bfloat16: calls from this many rows run widened to float32 (above)
WIDEN_SMALL_ROWS = 32   # widen_bfloat16: the small-batch kernel takes calls up to this many rows (above)
WIDEN_BLOCK_FLOATS = 4 << 20   # the float32 copy of a weight block a widened call holds at once (16 MB)


class Linear(nn.Linear):
    """y = x Wᵀ + b; after pack() through a CPU GEMM with W held packed instead of `weight`."""

    packed: torch.Tensor | cpu_gemm.PackedWeight | None = None   # the weight in the GEMM's layout, once packed
    gemm = "torch"                       # which GEMM runs it: torch (F.linear), native or onednn
    fused = False                        # ops in the GEMM epilogue (float32 only, see pack)
    small: SmallLinear | None = None     # the small-batch kernel, once use_small() gave it
    plain: BoundWeight | None = None     # the weight as loaded (and the bias in float32), bound to it
    _plain_on_onednn = False             # native: calls of many rows on the plain weight via oneDNN (else F.linear)
    widen_min_rows: int | None = None    # widen_bfloat16: bfloat16 calls of this many rows run in float32
    small_rows = SMALL_ROWS              # calls of at most this many rows go to the small-batch kernel

    def use_small(self, kernel: SmallLinear, place=None) -> None:
        """Calls with at most `small_rows` rows run on `kernel` (float32 and bfloat16 weights).
        place: where the weight moves first (a copy function, e.g. host_memory.on_huge_pages);
        the layer's own weight is then that copy too, so nothing is kept twice."""
        weight = self.weight.detach()
        if weight.dtype not in (torch.float32, torch.bfloat16) or weight.device.type != "cpu":
            raise ValueError(f"the small-batch linear runs float32 and bfloat16 on CPU, not {weight.dtype} "
                             f"on {weight.device}")
        if place is not None:
            weight = place(weight)
            self.weight.data = weight   # a tied weight's other user (the embedding) moves with it
        bias = None if self.bias is None else self.bias.detach().float().contiguous()
        self.small, self.plain = kernel, kernel.bind(weight.contiguous(), bias)

    def _few_rows(self, x: torch.Tensor) -> bool:
        return self.small is not None and x.dim() == 2 and x.shape[0] <= self.small_rows

    def _many_rows(self, x: torch.Tensor) -> bool:
        """A native linear's call better run on the plain weight (the module docstring)."""
        return self.plain is not None and x.dim() == 2 and x.shape[0] > NATIVE_MAX_ROWS

    def _on_plain(self, x: torch.Tensor, op: str = "none", other: torch.Tensor | None = None) -> torch.Tensor:
        w, b = self.plain.weight, self.plain.bias
        if self._plain_on_onednn:
            return onednn.linear_op(x, w, b, op, other)
        return _op_after(F.linear(x, w, b), op, other)

    def _native_call(self, x: torch.Tensor, op: str = "none", other: torch.Tensor | None = None) -> torch.Tensor:
        if self._many_rows(x):
            return self._on_plain(x, op, other)
        return self._native(x, self.packed, op, other)

    def _small(self, x: torch.Tensor, op: str = "none", other: torch.Tensor | None = None) -> torch.Tensor:
        if x.dtype == torch.float32:
            return self.plain(x, op, other)
        # bfloat16: the matmul rounds once, the op runs after it in bfloat16, as transformers does
        return _op_after(self.plain(x.float()).to(x.dtype), op, other)

    def widen_bfloat16(self) -> None:
        """bfloat16 calls of up to WIDEN_SMALL_ROWS rows run on the small-batch kernel where
        use_small() bound it, more (or from WIDEN_MIN_ROWS without it) widened to float32 (the
        module docstring): for a bfloat16 weight on F.linear, on a CPU without bfloat16 matmuls."""
        if self.gemm != "torch" or self.weight.dtype != torch.bfloat16 or self.weight.device.type != "cpu":
            raise ValueError("only a bfloat16 weight on F.linear, on CPU, runs widened")
        self.widen_min_rows, self.small_rows = WIDEN_MIN_ROWS, WIDEN_SMALL_ROWS

    def _widens(self, x: torch.Tensor) -> bool:
        return self.widen_min_rows is not None and x.dim() == 2 and x.shape[0] >= self.widen_min_rows

    def _widened(self, x: torch.Tensor) -> torch.Tensor:
        """x Wᵀ + b in float32 over the weight widened block by block, rounded once to x's dtype."""
        weight, n_out = self.weight.detach(), self.out_features
        x32 = x.float()
        bias = None if self.bias is None else self.bias.detach().float()
        block = max(1, WIDEN_BLOCK_FLOATS // weight.shape[1])
        if block >= n_out:
            return F.linear(x32, weight.float(), bias).to(x.dtype)
        out = torch.empty(x.shape[0], n_out, dtype=x.dtype)
        for first in range(0, n_out, block):
            part = slice(first, min(first + block, n_out))
            out[:, part] = F.linear(x32, weight[part].float(), None if bias is None else bias[part])
        return out

    def pack(self, gemm: str = "onednn") -> None:
        """Repacks the weight for `gemm` ("native" or "onednn") and drops the plain copy (a
        tied weight's other user keeps its own reference).

        Epilogues are fused in float32 only: they compute in float32 and round
        once, which in bfloat16 would skip the rounding transformers does after
        each op, and move logits well past rounding on the tiny test models."""
        weight = self.weight.detach()
        if gemm == "native":
            if weight.dtype != torch.float32:
                raise ValueError(f"the native CPU GEMM runs float32, not {weight.dtype}")
            self._native = cpu_gemm.load()
            packed = self._native.pack(weight, self.bias)   # checked once here, not per call
            self._plain_on_onednn = onednn.onednn_available(torch.float32)   # calls of many rows
        elif gemm == "onednn":
            packed = onednn.pack(weight)
        else:
            raise ValueError(f"cannot pack for {gemm!r}: native or onednn")
        self.fused = weight.dtype == torch.float32
        del self.weight                       # the Parameter: packed replaces it
        self.packed, self.gemm = packed, gemm

    def forward(self, x: torch.Tensor) -> torch.Tensor:     # (..., in) -> (..., out)
        if self._few_rows(x):
            return self._small(x)
        if self.gemm == "native":
            return self._native_call(x)
        if self.gemm == "onednn":   # the ops kernels/onednn.py probes (onednn_available)
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        if self._widens(x):   # silu, mul and add come here too, their op after the rounding
            return self._widened(x)
        return F.linear(x, self.weight, self.bias)

    def silu(self, x: torch.Tensor) -> torch.Tensor:
        """silu(x Wᵀ + b)."""
        if self._few_rows(x):
            return self._small(x, "silu")
        if self.gemm == "native":
            return self._native_call(x, "silu")
        if self.fused:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "swish", [], "")
        return F.silu(self(x))

    def mul(self, x: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
        """(x Wᵀ + b) * other; other has the output's shape."""
        if self._few_rows(x):
            return self._small(x, "mul", other)
        if self.gemm == "native":
            return self._native_call(x, "mul", other)
        if self.fused:
            return torch.ops.mkldnn._linear_pointwise.binary(x, other, self.packed, self.bias, "mul")
        return self(x) * other

    def add(self, x: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
        """(x Wᵀ + b) + other (a residual); other has the output's shape."""
        if self._few_rows(x):
            return self._small(x, "add", other)
        if self.gemm == "native":
            return self._native_call(x, "add", other)
        if self.fused:
            return torch.ops.mkldnn._linear_pointwise.binary(x, other, self.packed, self.bias, "add")
        return self(x) + other


def _op_after(y: torch.Tensor, op: str, other: torch.Tensor | None) -> torch.Tensor:
    """op on a matmul's fresh output y, in place (a linear's unfused forms: silu, mul, add)."""
    if op == "silu":
        return F.silu(y, inplace=True)
    return y if op == "none" else (y.mul_(other) if op == "mul" else y.add_(other))
