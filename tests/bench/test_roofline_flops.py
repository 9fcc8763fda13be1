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
