"""The Llama-family decoder (Llama, Mistral, Qwen2, Qwen3) over a packed, paged batch.

One forward call runs one engine step: every token of every sequence in one
(T, hidden) tensor (see model_service/batch.py). Per layer:

    x ─ norm ─ qkv (one matmul) ─ [q/k norm] ─ rope ─ backend: write K/V to pages,
      │                                                attend over the pages
      └──────────────────────────── + ── o_proj ◄────┘   (the add is o_proj's epilogue)
    x ─ norm ─ gate_up (one matmul) ─ silu(gate) * up ─ down ─ + x

The LM head runs only on batch.logits_indices rows. On CPU, pack() moves every
matmul to a packed GEMM (native or oneDNN) with the element-wise ops fused in
(model/linear.py); and with use_decode_kernel(), a decode step of a few sequences
whose attention backend reads the pages natively (cpu) runs every layer above, the final norm
and the LM head in one native call (kernels/decode_layer.py), the same pieces without Python
between them.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

from kvserve.model_service.attention.base import AttentionBackend
from kvserve.model_service.batch import ForwardBatch
from kvserve.model_service.kernels.decode_layer import DecodeLayerKernel, DirectStep, Geometry, Unsupported
from kvserve.model_service.model.config import ModelConfig
from kvserve.model_service.model.layers import GatedMLP, RMSNorm
from kvserve.model_service.model.linear import Linear
from kvserve.model_service.model.rope import RotaryEmbedding, apply_rope

KVCaches = list[tuple[torch.Tensor, torch.Tensor]]  # per layer: (k_cache, v_cache)
log = logging.getLogger(__name__)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.scale = config.head_dim ** -0.5
        self.split_sizes = [config.q_size, config.kv_size, config.kv_size]
        # [q_proj; k_proj; v_proj] stacked on the output dim.
        self.qkv_proj = Linear(config.hidden_size, sum(self.split_sizes), bias=config.qkv_bias)
        self.o_proj = Linear(config.q_size, config.hidden_size, bias=config.o_bias)
        self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.rope_kernel = None   # kernels/rope.py's, once CausalLM.use_cpu_kernels() gave it

    def forward(self, x: torch.Tensor, residual: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                k_cache: torch.Tensor, v_cache: torch.Tensor,
                backend: AttentionBackend, meta: Any) -> torch.Tensor:
        """-> residual + attention(x), (T, hidden)."""
        t = x.shape[0]
        q, k, v = self.qkv_proj(x).split(self.split_sizes, dim=-1)
        q = q.view(t, self.num_heads, self.head_dim)      # (T, H, D)
        k = k.view(t, self.num_kv_heads, self.head_dim)   # (T, Hk, D)
        v = v.view(t, self.num_kv_heads, self.head_dim)   # (T, Hk, D)
        if self.q_norm is not None:
            q = self.q_norm(q)
            k = self.k_norm(k)
        rotated = None if self.rope_kernel is None else self.rope_kernel.rotate_pair(q, k, cos, sin)
        if rotated is not None:   # in place: qkv's output is ours
            q, k = rotated
        else:
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out = backend.forward(q, k, v, k_cache, v_cache, meta, self.scale)  # (T, H, D)
        return self.o_proj.add(out.reshape(t, -1), residual)  # (T, hidden)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size, config.mlp_bias)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                k_cache: torch.Tensor, v_cache: torch.Tensor,
                backend: AttentionBackend, meta: Any) -> torch.Tensor:  # (T, hidden)
        x = self.self_attn(self.input_layernorm(x), x, cos, sin, k_cache, v_cache, backend, meta)
        return self.mlp(self.post_attention_layernorm(x), x)

    def decode_weights(self) -> dict[str, torch.Tensor | None]:
        """The layer's tensors as kernels/decode_layer.py binds them: the plain weights the
        small-batch linear reads (use_small() first), biases in float32, None where absent."""
        attn, mlp = self.self_attn, self.mlp
        linears = {"qkv": attn.qkv_proj, "o": attn.o_proj, "down": mlp.down_proj}
        if mlp.gate_up_proj is None:   # packed: gate and up are their own linears
            linears.update(gate=mlp.gate_proj, up=mlp.up_proj)
        if any(linear.plain is None for linear in linears.values()) or (
                mlp.gate_up_proj is not None and mlp.gate_up_proj.plain is None):
            raise ValueError("the fused decode layer reads the small-batch linear's plain weights: use_small() first")
        out: dict[str, torch.Tensor | None] = {}
        for name, linear in linears.items():
            out[name], out[f"{name}_bias"] = linear.plain.weight, linear.plain.bias
        if mlp.gate_up_proj is not None:   # [gate; up] in one matrix: its two halves, rows contiguous
            fused, size = mlp.gate_up_proj.plain, mlp.intermediate_size
            for name, rows in (("gate", slice(0, size)), ("up", slice(size, None))):
                out[name] = fused.weight[rows]
                out[f"{name}_bias"] = None if fused.bias is None else fused.bias[rows]
        out["input_norm"] = self.input_layernorm.weight.detach()
        out["post_norm"] = self.post_attention_layernorm.weight.detach()
        out["q_norm"] = None if attn.q_norm is None else attn.q_norm.weight.detach()
        out["k_norm"] = None if attn.k_norm is None else attn.k_norm.weight.detach()
        return out


ROPE_TABLE_START = 8192   # positions the rotary table holds before anything is served


class CausalLM(nn.Module):
    """Parameter names follow HF's with "model." dropped and q/k/v, gate/up fused."""

    decode_kernel: DecodeLayerKernel | None = None   # use_decode_kernel()'s
    decode_whole = None   # and the step after the embedding bound to it: every layer, norm, LM head
    decode_ints: DirectStep | None = None   # and the same step from plain ints, embedding included

    def __init__(self, config: ModelConfig, device: torch.device | str | None = None,
                 dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        # Built on `device` even when the layers are built on "meta" (see loader); no longer than
        # ROPE_TABLE_START at first (a config's length can be 2^40), then as long as the positions
        # served need (rope.reserve(), lookup()).
        self.rope = RotaryEmbedding(config, min(config.max_model_len, ROPE_TABLE_START), device=device, dtype=dtype)
        if config.tie_word_embeddings:
            self.tie_weights()

    def tie_weights(self) -> None:
        self.lm_head.weight = self.embed_tokens.weight

    def linears(self) -> list[Linear]:
        return [linear for layer in self.layers
                for linear in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, *layer.mlp.linears())] + [self.lm_head]

    def use_small(self, kernel, place=None) -> None:
        """Matmuls of a few rows on the small-batch kernel (model/linear.py); before pack().
        place: where each weight moves first (Linear.use_small)."""
        for linear in self.linears():
            linear.use_small(kernel, place)

    def widen_bfloat16(self) -> None:
        """Prefill-sized bfloat16 matmuls in float32 on a CPU without bfloat16 ones (Linear.widen_bfloat16)."""
        for linear in self.linears():
            linear.widen_bfloat16()

    def use_cpu_kernels(self, norm=None, rope=None) -> None:
        """Every RMSNorm and RoPE in one native call each where it can (kernels/rms_norm.py, rope.py)."""
        for module in self.modules():
            if isinstance(module, RMSNorm) and norm is not None:
                module.use_kernel(norm)
            if isinstance(module, Attention):
                module.rope_kernel = rope

    def use_decode_kernel(self, kernel: DecodeLayerKernel | None) -> None:
        """Decode steps of a few rows, where the backend decodes natively, run every layer, the final
        norm and the LM head in one call of `kernel` (kernels/decode_layer.py), float32 or bfloat16;
        None (or an LM head off the small-batch kernel): module by module. After use_small() (and
        pack())."""
        self.decode_kernel = self.decode_whole = self.decode_ints = None
        head = self.lm_head.plain   # the small-batch kernel's weight, which the step streams
        if kernel is None or head is None or head.bias is not None or head.weight.dtype != self.norm.weight.dtype:
            return
        c = self.config
        self.decode_geometry = Geometry(c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim,
                                        c.intermediate_size, c.rms_norm_eps, self.norm.weight.dtype)
        try:
            layers = [kernel.bind(self.decode_geometry, layer.decode_weights()) for layer in self.layers]
        except Unsupported as exc:   # a geometry the kernel does not take (the attention backend serves it)
            log.info("decode steps run layer by layer: %s", exc)
            return
        self.decode_whole = kernel.bind_step(layers, self.norm.weight.detach(), head.weight, self.norm.eps)
        self.decode_kernel = kernel
        embedding = self.embed_tokens.weight.detach()
        if embedding.dtype == self.decode_geometry.dtype and embedding.is_contiguous():
            self.decode_ints = DirectStep(self.decode_whole, embedding, lambda: (self.rope.cos, self.rope.sin))

    def pack(self, gemm: str) -> None:
        """Every matmul to a packed CPU GEMM, "native" or "onednn" (model/linear.py). Irreversible."""
        for layer in self.layers:
            layer.self_attn.qkv_proj.pack(gemm)
            layer.self_attn.o_proj.pack(gemm)
            layer.mlp.pack(gemm)
        self.lm_head.pack(gemm)   # tied: the embedding keeps its own reference to the weight

    @torch.no_grad()   # not inference_mode: its tensors (reused buffers) would refuse later in-place use
    def forward(self, batch: ForwardBatch, kv_caches: KVCaches,
                backend: AttentionBackend, meta: Any) -> torch.Tensor:
        """-> logits (S, vocab) float32 for the rows batch.logits_indices names."""
        x = self.embed_tokens(batch.input_ids)            # (T, hidden)
        cos, sin = self.rope.lookup(batch.positions, batch.max_seqlen_k)      # (T, 1, D/2) each, shared by all layers
        step = self._decode_step(batch, x, cos, sin, kv_caches, backend, meta)
        if step is not None:   # the rest of the step in one native call
            logits = self.decode_whole(x, step, kv_caches)
            return logits if len(batch.logits_indices) == step.rows else logits[batch.logits_indices]
        per_layer = getattr(meta, "for_layer", None)   # layers that mask differently (some slide)
        for i, (layer, (k_cache, v_cache)) in enumerate(zip(self.layers, kv_caches, strict=True)):
            x = layer(x, cos, sin, k_cache, v_cache, backend, meta if per_layer is None else per_layer(i))
        x = self.norm(x[batch.logits_indices])            # (S, hidden): norm is per row
        return self.lm_head(x).float()                    # (S, vocab)

    def _decode_step(self, batch: ForwardBatch, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                     kv_caches: KVCaches, backend: AttentionBackend, meta: Any):
        """The fused decode layers' step arguments, or None where this step runs module by module."""
        if self.decode_kernel is None:
            return None
        pages = backend.native_decode(meta)   # (tables, lens) of a decode-only step, or None
        if pages is None:
            return None
        return self.decode_kernel.step(self.decode_geometry, x, cos, sin, batch.slot_mapping, *pages, kv_caches[0][0])
