"""The building blocks: RMSNorm and the gated SiLU MLP."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvserve.model_service.model.linear import Linear


class RMSNorm(nn.Module):
    """x / rms(x) * weight over the last dim, as transformers computes it.

    The normalisation runs in float32 whatever the input dtype; the result is
    cast back to the input dtype *before* the weight multiplies it (so in
    bfloat16 the product is rounded like HF's, not computed in float32).
    """

    kernel = None   # kernels/rms_norm.py's, once use_kernel() gave it: the same in one call

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def use_kernel(self, kernel) -> None:
        self.kernel = kernel

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (..., size) -> (..., size)
        if self.kernel is not None:
            y = self.kernel.maybe(x, self.weight, self.eps)
            if y is not None:
                return y
        dtype = x.dtype
        x32 = x.float()
        variance = x32.pow(2).mean(-1, keepdim=True)    # (..., 1)
        return self.weight * (x32 * torch.rsqrt(variance + self.eps)).to(dtype)


class GatedMLP(nn.Module):
    """residual + down(silu(gate(x)) * up(x)).

    Loaded with gate and up in one matmul: gate_up_proj.weight is
    [gate_proj.weight; up_proj.weight] stacked on the output dim, so the first
    half of its output is the gate. pack() splits it in two packed matmuls
    instead, so that silu, the product and the residual add all run in GEMM
    epilogues: no pass over the (T, intermediate) activations of its own.
    """

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False) -> None:
        super().__init__()
        self.intermediate_size = intermediate_size
        self.gate_up_proj: Linear | None = Linear(hidden_size, 2 * intermediate_size, bias=bias)
        self.gate_proj: Linear | None = None   # set by pack()
        self.up_proj: Linear | None = None
        self.down_proj = Linear(intermediate_size, hidden_size, bias=bias)

    def linears(self) -> list[Linear]:
        return [linear for linear in (self.gate_up_proj, self.gate_proj, self.up_proj, self.down_proj)
                if linear is not None]

    def pack(self, gemm: str) -> None:
        fused, size = self.gate_up_proj, self.intermediate_size
        self.gate_proj, self.up_proj = (_linear_from(fused, rows) for rows in (slice(0, size), slice(size, None)))
        self.gate_up_proj = None
        for linear in (self.gate_proj, self.up_proj, self.down_proj):
            linear.pack(gemm)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:  # (T, hidden) -> (T, hidden)
        if self.gate_up_proj is not None:
            gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)  # (T, I) each
            h = F.silu(gate) * up
        else:
            h = self.up_proj.mul(x, self.gate_proj.silu(x))                      # (T, I)
        return self.down_proj.add(h, residual)


def _linear_from(linear: Linear, rows: slice) -> Linear:
    """A Linear holding `rows` of `linear`'s outputs (sharing its memory)."""
    weight = linear.weight[rows]
    part = Linear(weight.shape[1], weight.shape[0], bias=linear.bias is not None,
                  device="meta", dtype=weight.dtype)
    part.weight = nn.Parameter(weight, requires_grad=False)
    if linear.bias is not None:
        part.bias = nn.Parameter(linear.bias[rows], requires_grad=False)
    if linear.small is not None:
        part.use_small(linear.small)   # its rows of the plain weight: contiguous, no copy
    return part
