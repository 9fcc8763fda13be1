"""Rotary position embedding: a cos/sin table indexed by each token's position.

The arithmetic follows transformers' Llama rope step for step, so that float32
results are the same bits: inv_freq = 1 / theta ** (arange(0, D, 2) / D), the
angle is position * inv_freq in float32, cos/sin are cast to the model dtype,
and x * cos + rotate_half(x) * sin is computed in the model dtype. The table
keeps only one half of each row (HF concatenates two equal halves).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from kvserve.model_service.model.config import Llama3RopeScaling, ModelConfig


def inverse_frequencies(config: ModelConfig) -> torch.Tensor:  # (D/2,) float32, on CPU
    dim = config.head_dim
    exponents = torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim
    inv_freq = 1.0 / (config.rope_theta ** exponents)
    if config.rope_scaling is not None:
        inv_freq = _llama3_scaled(inv_freq, config.rope_scaling)
    return inv_freq


def _llama3_scaled(inv_freq: torch.Tensor, s: Llama3RopeScaling) -> torch.Tensor:
    """Llama 3.1: keep high frequencies, divide low ones by `factor`, blend in between."""
    low_freq_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    high_freq_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
        s.high_freq_factor - s.low_freq_factor)
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """cos/sin for positions 0 .. max_len-1, built once; `lookup` gathers a step's rows."""

    def __init__(self, config: ModelConfig, max_len: int, device: torch.device | str | None = None,
                 dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.inv_freq = inverse_frequencies(config).to(device)               # (D/2,)
        self.dtype = dtype
        self.register_buffer("cos", torch.empty(0), persistent=False)
        self.register_buffer("sin", torch.empty(0), persistent=False)
        self._build(max_len)

    def _build(self, max_len: int) -> None:
        positions = torch.arange(max_len, device=self.inv_freq.device, dtype=torch.int64).float()
        angles = positions[:, None] * self.inv_freq[None, :]                 # (max_len, D/2)
        self.cos, self.sin = angles.cos().to(self.dtype), angles.sin().to(self.dtype)

    def reserve(self, max_len: int) -> None:
        """The table holds positions 0 .. max_len-1 from now on (a server, for its model length)."""
        if max_len > self.cos.shape[0]:
            self._build(max_len)

    def lookup(self, positions: torch.Tensor, max_len: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """positions (T,) -> cos, sin (T, 1, D/2), broadcasting over heads. max_len: one past the
        largest position; past the table (a stream with attention sinks goes on past the model's
        length) it is rebuilt twice as long."""
        if max_len > self.cos.shape[0]:
            self._build(2 * max_len)
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (T, H, D), cos/sin (T, 1, D/2) -> (T, H, D).

    [x1, x2] -> [x1*cos - x2*sin, x2*cos + x1*sin]: HF's x*cos + rotate_half(x)*sin
    with the two halves written out (a + (-b) and a - b are the same float).
    """
    x1, x2 = x.chunk(2, dim=-1)                                              # (T, H, D/2) each
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
