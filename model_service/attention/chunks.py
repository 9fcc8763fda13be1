"""A prefill chunk behind a cached prefix (a chat turn, a long prompt's second chunk), as
two matmuls and a softmax per KV head instead of SDPA, two ways behind one shape.

Query i of such a chunk sits at absolute position cached + i and sees keys 0 .. cached + i:
an explicit mask, and with one SDPA's CPU kernel runs its matmuls through MKL, slow on AMD
(docs/benchmarks.md). On CPU in float32, a chunk inside a measured window instead takes
masked_chunk_matmul: small chunks would pay the products' per-call cost and huge ones their
(G*L, S) score matrix, so those stay with SDPA.

    uses_matmul(device, queries, keys) -> bool    the window, and whether the products run here
    bias(mask) -> tensor | None                   what the softmax needs of the mask, per step
    __call__(q, keys, values, chunk, scale)       q (Hk, G, L, D), keys / values (Hk, S, D)
    causal(q, keys, values, cached, scale)        q (L, H, D) float32, keys / values (S, Hk, D)
                                                  of the pages' dtype: a chunk without a window
                                                  in one native call, or None where there is none

OneDnnChunks (torch backend): oneDNN products, torch's softmax over an additive 0 / -inf bias.
NativeChunks (cpu backend): every float32 chunk without a window, fresh or behind a cached
prefix, through the native causal flash attention (kernels/paged_decode.c) where it is built
(AVX-512): faster here than SDPA and the matmul path at every size measured (docs/benchmarks.md).
Not in bfloat16: there SDPA's path gives transformers' bfloat16 logits bit for bit
(tests/model/test_loader.py), where the kernel's float32 sums moved a tiny model's by up to 0.07.
Elsewhere the matmul path: scale, causal mask and softmax in one native pass, the products on
the native GEMM where it runs (keys and values packed as they come, with no copy first), else on
oneDNN.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvserve.model_service.kernels.cpu_gemm import CpuGemm
from kvserve.model_service.kernels.onednn import matmul_nt, onednn_available
from kvserve.model_service.kernels.paged_decode import PagedDecodeKernel

MATMUL_MIN_QUERIES = 64      # below, the products' per-call cost outweighs their faster GEMM
MATMUL_MAX_SCORES = 1 << 20  # queries x keys; above, the (G*L, S) scores cost more than SDPA's tiles


@dataclass(slots=True)
class PrefillChunk:
    start: int                 # first query row in the batch
    end: int                   # one past the last query row
    seq_len: int               # keys to attend: cached + this chunk
    pages: torch.Tensor        # (ceil(keys / page_size) or more,) int64 page ids
    masked: bool               # keys cached before it or a window: SDPA needs a mask; else plain causal
    window: int | None = None  # a sliding window that masks its keys too (not plain causal), or None
    matmul: bool = False       # attention as two matmuls and a softmax, not SDPA
    # Built by the backend when a path first needs them (PagedAttention.chunk_mask), then shared by
    # every layer: a native causal kernel needs neither.
    mask: torch.Tensor | None = None  # (L, keys) bool, True = attend
    bias: torch.Tensor | None = None  # what the matmul path's softmax needs of the mask, if anything
    # A window's chunk far into its sequence: `pages` are only those its queries' windows and the
    # sinks reach, and these their keys' positions (keys = len); None: pages from 0, keys = seq_len.
    key_positions: torch.Tensor | None = None

    @property
    def keys(self) -> int:
        return self.seq_len if self.key_positions is None else self.key_positions.numel()


def in_window(device: torch.device, queries: int, keys: int) -> bool:
    return device.type == "cpu" and MATMUL_MIN_QUERIES <= queries and queries * keys <= MATMUL_MAX_SCORES


class OneDnnChunks:
    def uses_matmul(self, device: torch.device, queries: int, keys: int) -> bool:
        return in_window(device, queries, keys) and onednn_available(torch.float32)

    def bias(self, mask: torch.Tensor) -> torch.Tensor:
        """An additive 0 / -inf bias (L, S)."""
        return torch.zeros(mask.shape, device=mask.device).masked_fill_(~mask, float("-inf"))

    def __call__(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                 chunk: PrefillChunk, scale: float) -> torch.Tensor:
        return masked_chunk_matmul(q, keys, values, onednn_scores, onednn_mix,
                                   functools.partial(scaled_masked_softmax, bias=chunk.bias, scale=scale))

    def causal(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, cached: int,
               scale: float) -> None:
        return None   # the reference backend attends with torch's own ops


class NativeChunks:
    def __init__(self, kernel: PagedDecodeKernel, gemm: CpuGemm | None = None) -> None:
        self.kernel = kernel
        self.gemm = gemm   # the native GEMM for the products; None: oneDNN's

    def uses_matmul(self, device: torch.device, queries: int, keys: int) -> bool:
        return in_window(device, queries, keys) and (self.gemm is not None or onednn_available(torch.float32))

    def bias(self, mask: torch.Tensor) -> None:
        return None   # the native softmax masks by position

    def causal(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, cached: int,
               scale: float) -> torch.Tensor | None:
        if q.dtype != torch.float32 or not self.kernel.takes_causal(q.shape[2]):
            return None
        return self.kernel.causal_attention(q, keys.float(), values.float(), cached, scale)

    def __call__(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                 chunk: PrefillChunk, scale: float) -> torch.Tensor:
        length = q.shape[2]
        softmax = functools.partial(self.kernel.chunk_softmax, chunk=length,
                                    cached=chunk.seq_len - length, scale=scale)
        if self.gemm is None:
            return masked_chunk_matmul(q, keys, values, onednn_scores, onednn_mix, softmax)
        gemm = self.gemm
        return masked_chunk_matmul(
            q, keys, values, lambda rows, k: gemm(rows, gemm.pack(k)),
            lambda probs, v: gemm(probs, gemm.pack_transposed(v)), softmax)


Product = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def masked_chunk_matmul(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scores_of: Product,
                        mix: Product, softmax: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """Attention of one chunk as two matmuls and a softmax per KV head: q (Hk, G, L, D), keys /
    values (Hk, S, D) -> (Hk, G, L, D). A KV head's G query heads' rows form one (G*L, D) matrix,
    so each K/V is read once by one larger GEMM. scores_of(rows (G*L, D), keys (S, D)) -> (G*L, S);
    softmax: raw scores -> probabilities, scaled and masked (it may work in place);
    mix(probs (G*L, S), values (S, D)) -> (G*L, D)."""
    hk, g, length, d = q.shape
    out = torch.empty_like(q)
    for h in range(hk):
        probs = softmax(scores_of(q[h].reshape(g * length, d), keys[h]))
        out[h] = mix(probs, values[h]).view(g, length, d)
    return out


def onednn_scores(rows: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    return matmul_nt(rows, keys.contiguous())


def onednn_mix(probs: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    return matmul_nt(probs, values.t().contiguous())


def scaled_masked_softmax(scores: torch.Tensor, bias: torch.Tensor, scale: float) -> torch.Tensor:
    """scores (G*L, S) -> softmax(scale * scores + bias) per row, bias (L, S) 0 / -inf."""
    rows, keys = scores.shape
    scores.view(-1, bias.shape[0], keys).mul_(scale).add_(bias)
    return torch.softmax(scores, dim=-1)
