"""What the benchmarks' rooflines count of a model (a ModelConfig, or anything with its fields):
the parameters of one layer's matmuls and of the LM head. The embedding table is left out: a
step reads it a row per token."""

from __future__ import annotations


def matmul_params(cfg) -> tuple[int, int]:
    """(one layer's q, k, v, o and MLP weights, the LM head's)."""
    h, kv, q = cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, cfg.num_heads * cfg.head_dim
    return h * q + 2 * h * kv + q * h + 3 * h * cfg.intermediate_size, h * cfg.vocab_size
