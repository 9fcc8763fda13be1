"""The `cpu` attention backend: the torch backend, with decode rows through a native kernel.

Decode attention is most of what grows with context on CPU: the torch backend
gathers every decode page into a buffer and runs SDPA over it, so each key and
value is read twice and written once. paged_decode.c reads each page once, from
the cache, in torch's OpenMP pool. A chunk behind a cached prefix (a chat turn)
takes the torch backend's matmul path with a native softmax and, where it runs,
the native GEMM; fresh prompts, the cache write and every other shape stay
exactly the torch backend's. float32 only (the kernel's type);
`auto` picks this backend on CPU when the kernel builds, and `torch` stays the
reference (docs/benchmarks.md has the measurements).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from kvserve.model_service.attention.cpu_decode_kernel import PagedDecodeKernel
from kvserve.model_service.attention.torch_backend import (
    MATMUL_MAX_SCORES, MATMUL_MIN_QUERIES, PrefillChunk, TorchAttentionBackend, masked_chunk_matmul, onednn_mix,
    onednn_scores)
from kvserve.model_service.batch import ForwardBatch
from kvserve.model_service.model.cpu_gemm import CpuGemm
from kvserve.model_service.model.linear import onednn_available


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

    def __init__(self, kernel: PagedDecodeKernel, gemm: CpuGemm | None = None) -> None:
        super().__init__()
        self.kernel = kernel
        self.gemm = gemm   # the native GEMM, for a cached-prefix chunk's products; None: oneDNN's

    def prepare(self, batch: ForwardBatch) -> CpuAttentionMeta:
        nd = batch.num_decodes
        prefills = self.prepare_prefills(batch, batch.block_tables.long()) if nd < batch.num_seqs else []
        return CpuAttentionMeta(batch.slot_mapping, nd, batch.block_tables[:nd].contiguous(),
                                batch.seq_lens[:nd].contiguous(), max(batch.seq_lens_cpu[:nd], default=0),
                                prefills)

    def matmul_path(self, device: torch.device, queries: int, keys: int) -> bool:
        """The torch backend's window, on the native GEMM where oneDNN is missing."""
        return (device.type == "cpu" and MATMUL_MIN_QUERIES <= queries and queries * keys <= MATMUL_MAX_SCORES
                and (self.gemm is not None or onednn_available(torch.float32)))

    def chunk_bias(self, mask: torch.Tensor) -> None:
        return None   # the native softmax masks by position

    def masked_chunk(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                     chunk: PrefillChunk, scale: float) -> torch.Tensor:
        """A cached-prefix chunk (a chat turn) as the torch backend's matmul path, natively:
        scale, causal mask and softmax in one pass (torch takes three: 64 -> ~20 us a KV head and
        layer for 80 queries behind 560 cached keys), and the two products on the native GEMM
        where it runs, keys and values packed as they come, with no copy first (491 -> 417 us a
        layer); else on oneDNN."""
        length = q.shape[2]
        softmax = functools.partial(self.kernel.chunk_softmax, chunk=length,
                                    cached=chunk.seq_len - length, scale=scale)
        if self.gemm is None:
            return masked_chunk_matmul(q, keys, values, onednn_scores, onednn_mix, softmax)
        gemm = self.gemm
        return masked_chunk_matmul(
            q, keys, values, lambda rows, k: gemm(rows, gemm.pack(k)),
            lambda probs, v: gemm(probs, gemm.pack_transposed(v)), softmax)

    def _decode(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                meta: CpuAttentionMeta, scale: float) -> torch.Tensor:
        return self.kernel(q, k_cache, v_cache, meta.decode_tables, meta.decode_lens, scale,
                           meta.max_decode_len)
