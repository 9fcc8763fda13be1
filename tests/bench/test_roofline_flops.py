"""The throughput bench's roofline counts: checked against a count made the slow way."""

from __future__ import annotations

from types import SimpleNamespace

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from bench.throughput import attention_flops, matmul_flops, weight_flops

CFG = SimpleNamespace(hidden_size=64, num_layers=3, num_heads=4, num_kv_heads=2, head_dim=16,
                      intermediate_size=96, vocab_size=200)
PROMPTS = [[5] * 7, [5] * 1, [5] * 12]


def test_attention_flops_count_every_query_key_pair():
    new_tokens = 5
    pairs = 0
    for prompt in PROMPTS:
        for position in range(len(prompt) + new_tokens - 1):   # the last sampled token is never fed
            pairs += position + 1                              # causal: keys 0 .. position
    per_pair = 2 * 2 * CFG.head_dim * CFG.num_heads * CFG.num_layers   # Q K^T and P V
    assert attention_flops(CFG, PROMPTS, new_tokens) == per_pair * pairs


def test_weight_flops_match_the_models_linear_layers():
    hf = LlamaConfig(hidden_size=CFG.hidden_size, num_hidden_layers=CFG.num_layers,
                     num_attention_heads=CFG.num_heads, num_key_value_heads=CFG.num_kv_heads,
                     head_dim=CFG.head_dim, intermediate_size=CFG.intermediate_size,
                     vocab_size=CFG.vocab_size)
    with torch.device("meta"):
        model = LlamaForCausalLM(hf)
    layer_weights = sum(m.weight.numel() for m in model.model.layers.modules()
                        if isinstance(m, torch.nn.Linear))
    head = model.lm_head.weight.numel()
    new_tokens = 5
    fed = sum(len(p) + new_tokens - 1 for p in PROMPTS)   # tokens through the layers
    sampled = len(PROMPTS) * new_tokens                    # LM-head rows: one per sampled token
    assert weight_flops(CFG, PROMPTS, new_tokens) == 2.0 * (fed * layer_weights + sampled * head)
    assert matmul_flops(CFG, PROMPTS, new_tokens) == (weight_flops(CFG, PROMPTS, new_tokens)
                                                      + attention_flops(CFG, PROMPTS, new_tokens))


def test_the_roofline_takes_the_larger_of_compute_and_memory_in_each_phase():
    """Decode step k reads every linear weight and the K/V of every sequence so far; with a
    GEMM of unbounded speed only the bytes count, with memory of unbounded speed only FLOPs."""
    from bench.throughput import roofline_seconds

    new_tokens = 5
    layer = (CFG.hidden_size * CFG.num_heads * CFG.head_dim * 2 + 2 * CFG.hidden_size * CFG.num_kv_heads * CFG.head_dim
             + 3 * CFG.hidden_size * CFG.intermediate_size)
    weights = CFG.num_layers * layer + CFG.hidden_size * CFG.vocab_size
    kv_per_token = 2 * CFG.num_layers * CFG.num_kv_heads * CFG.head_dim
    contexts = [sum(map(len, PROMPTS)) + len(PROMPTS) * k for k in range(1, new_tokens)]
    prefill, decode = roofline_seconds(CFG, PROMPTS, new_tokens, rate=float("inf"), bandwidth=1.0)
    assert prefill == 4 * weights                                  # one pass over the weights
    assert decode == sum(4 * (weights + kv_per_token * c) for c in contexts)
    prefill, decode = roofline_seconds(CFG, PROMPTS, new_tokens, rate=1.0, bandwidth=float("inf"))
    assert prefill + decode == matmul_flops(CFG, PROMPTS, new_tokens)   # every matmul FLOP, once
