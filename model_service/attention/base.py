"""The interface every attention backend implements.

KV cache layout, per layer, shared by all backends (flash-attn's paged layout):

    k_cache, v_cache: (num_pages, page_size, num_kv_heads, head_dim)

A backend writes the step's new K/V into the cache at batch.slot_mapping, then
attends each query row to its sequence's keys 0 .. position (causal).
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from kvserve.model_service.batch import ForwardBatch


class AttentionBackend(Protocol):
    name: str

    def page_size_multiple(self) -> int:
        """The page size must be a multiple of this (flash-attn 2's paged kernels: 256)."""
        ...

    def default_page_size(self) -> int:
        """The page size used when none is given: a multiple of page_size_multiple() that the
        backend's kernels read fastest."""
        ...

    def prepare(self, batch: ForwardBatch) -> Any:
        """Per-step metadata (masks, index tensors), built once and shared by every layer."""
        ...

    def native_decode(self, meta: Any) -> tuple[torch.Tensor, torch.Tensor] | None:
        """For a step of decodes only, where this backend's decode reads the pages natively: its
        (num_seqs, max_pages) int32 page tables and (num_seqs,) int32 lengths, so that a fused
        layer may attend itself (kernels/decode_layer.py). None otherwise."""
        ...

    def decodes_natively(self) -> bool:
        """Whether native_decode() answers for every step of decodes only, so that such a step
        may go to a fused layer from plain ints without prepare() (kernels/decode_layer.DirectStep)."""
        ...

    def forward(
        self,
        q: torch.Tensor,        # (T, num_heads, head_dim)
        k: torch.Tensor,        # (T, num_kv_heads, head_dim)
        v: torch.Tensor,        # (T, num_kv_heads, head_dim)
        k_cache: torch.Tensor,  # (num_pages, page_size, num_kv_heads, head_dim)
        v_cache: torch.Tensor,
        meta: Any,
        scale: float,
    ) -> torch.Tensor:          # (T, num_heads, head_dim)
        ...
