"""The `cpu` attention backend: the torch backend, with decode rows through a native kernel.

Decode attention is most of what grows with context on CPU: the torch backend
gathers every decode page into a buffer and runs SDPA over it, so each key and
value is read twice and written once. paged_decode.c reads each page once, from
the cache, in torch's OpenMP pool. Prefill chunks, the cache write and every
other shape stay exactly the torch backend's. float32 only (the kernel's type);
`auto` picks this backend on CPU when the kernel builds, and `torch` stays the
reference (docs/benchmarks.md has the measurements).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch

from model_service.attention.cpu_decode_kernel import PagedDecodeKernel
from model_service.attention.torch_backend import PrefillChunk, TorchAttentionBackend
from model_service.batch import ForwardBatch


@dataclass(slots=True)
class CpuAttentionMeta:
    slot_mapping: torch.Tensor      # (T,) int64
    num_decodes: int
    decode_tables: torch.Tensor     # (num_decodes, max_pages) int32, rows contiguous
    decode_lens: torch.Tensor       # (num_decodes,) int32
    max_decode_len: int             # the longest of decode_lens
    prefills: list[PrefillChunk]


class CpuAttentionBackend(TorchAttentionBackend):
    name = "cpu"

    def __init__(self, kernel: PagedDecodeKernel) -> None:
        super().__init__()
        self.kernel = kernel

    def prepare(self, batch: ForwardBatch) -> CpuAttentionMeta:
        nd = batch.num_decodes
        prefills = self.prepare_prefills(batch, batch.block_tables.long()) if nd < batch.num_seqs else []
        return CpuAttentionMeta(batch.slot_mapping, nd, batch.block_tables[:nd].contiguous(),
                                batch.seq_lens[:nd].contiguous(), max(batch.seq_lens_cpu[:nd], default=0),
                                prefills)

    def chunk_softmax(self, chunk: PrefillChunk, length: int,
                      scale: float) -> Callable[[torch.Tensor], torch.Tensor]:
        """Scale, causal mask and softmax in one native pass (torch takes three; a chat turn's
        80 queries behind 560 cached keys: 64 -> ~20 us a KV head and layer)."""
        return functools.partial(self.kernel.chunk_softmax, chunk=length,
                                 cached=chunk.seq_len - length, scale=scale)

    def _decode(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                meta: CpuAttentionMeta, scale: float) -> torch.Tensor:
        return self.kernel(q, k_cache, v_cache, meta.decode_tables, meta.decode_lens, scale,
                           meta.max_decode_len)
