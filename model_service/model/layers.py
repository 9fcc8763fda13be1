"""The building blocks: RMSNorm and the gated SiLU MLP with gate and up fused."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    """x / rms(x) * weight over the last dim, as transformers computes it.

    The normalisation runs in float32 whatever the input dtype; the result is
    cast back to the input dtype *before* the weight multiplies it (so in
    bfloat16 the product is rounded like HF's, not computed in float32).
    """

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (..., size) -> (..., size)
        dtype = x.dtype
        x32 = x.float()
        variance = x32.pow(2).mean(-1, keepdim=True)    # (..., 1)
        return self.weight * (x32 * torch.rsqrt(variance + self.eps)).to(dtype)


class GatedMLP(nn.Module):
    """down(silu(gate(x)) * up(x)), with gate and up in one matmul.

    gate_up_proj.weight is [gate_proj.weight; up_proj.weight] stacked on the
    output dim, so the first half of the output is the gate.
    """

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False) -> None:
        super().__init__()
        self.intermediate_size = intermediate_size
        self.gate_up_proj = nn.Linear(hidden_size, 2 * intermediate_size, bias=bias)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (T, hidden) -> (T, hidden)
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)  # (T, I) each
        return self.down_proj(F.silu(gate) * up)
