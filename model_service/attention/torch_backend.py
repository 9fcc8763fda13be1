"""The reference attention backend: torch SDPA over pages gathered by page table.

Runs on CPU and on any GPU. Per layer:

1. Write the step's K/V: one index_copy_ of all T rows into the cache viewed as
   (num_pages * page_size, Hk, D), at batch.slot_mapping.
2. Decode rows (sequences [0, num_decodes), one query each) in a few batched
   calls, one per group of similar context lengths (decode_groups):

       keys    k_cache[block_tables[rows, :P]]  (n, P, page, Hk, D) -> (n, Hk, L, D)
       queries q[rows]                          (n, H, D) -> (n, Hk, G, D)
       mask    key index < seq_len              (n, 1, 1, L), built once per step

   G = H / Hk query heads share each KV head; grouping the queries by KV head
   puts the G queries in SDPA's query-length slot, so K/V are never repeated.
   One call for all rows would gather and attend every row up to the longest
   context; four groups of sorted lengths halve that work (bench model, 32
   decodes of contexts 32-512: 1.20 -> 0.63 ms a layer; docs/benchmarks.md).
   The scheduler sends decodes longest first, so each group is a row range,
   sliced; rows in any other order are indexed.
3. Prefill chunk rows: one SDPA per sequence over its gathered pages. Query i
   of a chunk sits at absolute position cached + i and sees keys 0 .. cached + i
   (causal, offset by the cached length); with nothing cached that is plain
   is_causal. Prefill is GEMM-bound (PERF_NOTES.md), so the loop is fine there.
   A chunk behind a cached prefix (a chat turn, a prompt's second chunk) needs
   an explicit mask, and SDPA's CPU kernel then runs its matmuls at ~110
   GFLOP/s (MKL's AVX2 code on AMD). On CPU in float32, a mid-sized one instead
   runs as two oneDNN matmuls and a softmax per KV head (masked_chunk_matmul):
   80 queries behind 544 cached keys 0.84 -> 0.63 ms a layer, 512 behind 512
   8.2 -> 4.7 ms. Small chunks pay oneDNN's per-call cost and huge ones its
   (L, S) score matrix, so those stay with SDPA.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvserve.model_service.batch import ForwardBatch
from kvserve.model_service.model.linear import matmul_nt, onednn_available


@dataclass(slots=True)
class PrefillChunk:
    start: int                 # first query row in the batch
    end: int                   # one past the last query row
    seq_len: int               # keys to attend: cached + this chunk
    pages: torch.Tensor        # (ceil(seq_len / page_size) or more,) int64 page ids
    mask: torch.Tensor | None  # (L, seq_len) bool, True = attend; None = plain causal (nothing cached)
    matmul: bool = False       # attention as two matmuls and a softmax (masked_chunk), not SDPA
    bias: torch.Tensor | None = None  # (L, seq_len) float32, 0 / -inf: the mask for torch's softmax there


@dataclass(slots=True)
class DecodeGroup:
    rows: torch.Tensor | slice  # (n,) int64 decode rows, longest context first; or a range of them
    tables: torch.Tensor       # (n, P) int64 page ids, P = pages of the longest context
    length: int                # the longest context in the group
    mask: torch.Tensor | None  # (n, 1, 1, length) bool, True = attend; None: all are `length` long


@dataclass(slots=True)
class TorchAttentionMeta:
    slot_mapping: torch.Tensor                # (T,) int64
    num_decodes: int
    decode_groups: list[DecodeGroup]
    prefills: list[PrefillChunk]


# Cached-prefix chunks that take the oneDNN matmul path (CPU, float32): measured window.
MATMUL_MIN_QUERIES = 64     # below, oneDNN's per-call cost outweighs its faster GEMM
MATMUL_MAX_SCORES = 1 << 20  # queries x keys; above, the (G*L, S) scores cost more than SDPA's tiles

ROWS_PER_DECODE_GROUP = 8   # fewer rows than this per group: the extra calls cost more than they save
MAX_DECODE_GROUPS = 4       # measured best at 32 decodes (3-8 within 10 %)


def decode_groups(seq_lens: list[int]) -> list[list[int]]:
    """Decode rows split into groups of similar context length, longest first."""
    count = min(MAX_DECODE_GROUPS, len(seq_lens) // ROWS_PER_DECODE_GROUP)
    if count <= 1:
        return [list(range(len(seq_lens)))]
    order = sorted(range(len(seq_lens)), key=seq_lens.__getitem__, reverse=True)
    size = -(-len(order) // count)
    return [order[i:i + size] for i in range(0, len(order), size)]


class PageGather:
    """Copies a batch's pages into reused buffers, one for K and one for V.

    The gathered K/V of a layer live only until its SDPA returns, so every layer
    (and every step) can reuse the same memory. A fresh multi-MB tensor per
    gather costs page faults: on the 2-core dev VM a bench-model decode gather
    (9 MB) took 12 ms into fresh memory, 1.25 ms into a reused buffer. The
    buffers grow to the largest step seen and stay.
    """

    def __init__(self) -> None:
        self._buffers: list[torch.Tensor | None] = [None, None]

    def __call__(self, which: int, cache: torch.Tensor, tables: torch.Tensor,
                 length: int) -> torch.Tensor:
        """cache (pages, page, Hk, D), tables (B, P) -> (B, length, Hk, D), `which` 0 = K, 1 = V."""
        b, p = tables.shape
        page_shape = cache.shape[1:]
        need = b * p * page_shape.numel()
        buf = self._buffers[which]
        if buf is None or buf.numel() < need or buf.dtype != cache.dtype or buf.device != cache.device:
            with torch.inference_mode(False):   # a normal tensor: writable in and out of inference mode
                buf = torch.empty(need, dtype=cache.dtype, device=cache.device)
            self._buffers[which] = buf
        rows = buf[:need].view(b * p, *page_shape)                          # (B*P, page, Hk, D)
        # index_select on the flattened table: ~3x faster than cache[tables] on CPU.
        torch.index_select(cache, 0, tables.reshape(-1), out=rows)
        return rows.view(b, p * page_shape[0], *page_shape[1:])[:, :length]


def _decode_group(batch: ForwardBatch, tables: torch.Tensor, rows: list[int]) -> DecodeGroup:
    """`rows` of the batch's decodes. Rows in order (the scheduler sends decodes longest
    first, so groups of sorted lengths are ranges) are sliced; others are indexed."""
    device = tables.device
    lens = [batch.seq_lens_cpu[i] for i in rows]
    length = max(lens)
    if rows == list(range(rows[0], rows[0] + len(rows))):
        index = slice(rows[0], rows[0] + len(rows))
        group_tables, group_lens = tables[index], batch.seq_lens[index]
    else:
        index = torch.tensor(rows, device=device)
        group_tables, group_lens = tables.index_select(0, index), batch.seq_lens.index_select(0, index)
    mask = None
    if min(lens) != length:
        key_idx = torch.arange(length, device=device)
        mask = (key_idx[None, :] < group_lens[:, None])[:, None, None, :]     # (n, 1, 1, L)
    return DecodeGroup(index, group_tables, length, mask)


class TorchAttentionBackend:
    name = "torch"

    def __init__(self) -> None:
        self.gather = PageGather()

    def page_size_multiple(self) -> int:
        return 1

    def prepare(self, batch: ForwardBatch) -> TorchAttentionMeta:
        nd = batch.num_decodes
        tables = batch.block_tables.long()                                  # (B, max_pages)
        groups = []
        if nd:
            groups = [_decode_group(batch, tables, rows) for rows in decode_groups(batch.seq_lens_cpu[:nd])]
        return TorchAttentionMeta(batch.slot_mapping, nd, groups, self.prepare_prefills(batch, tables))

    def prepare_prefills(self, batch: ForwardBatch, tables: torch.Tensor) -> list[PrefillChunk]:
        """One chunk per sequence after the decodes: its rows, pages and causal mask."""
        device = batch.input_ids.device
        nd = batch.num_decodes
        prefills = []
        starts = batch.cu_seqlens_q.tolist()
        for i in range(nd, batch.num_seqs):
            seq_len, q_len = batch.seq_lens_cpu[i], batch.query_lens_cpu[i]
            cached = seq_len - q_len
            mask = bias = None
            matmul = False
            if cached:
                q_pos = torch.arange(cached, seq_len, device=device)           # (L,)
                mask = torch.arange(seq_len, device=device)[None, :] <= q_pos[:, None]  # (L, S)
                matmul = self.matmul_path(device, q_len, seq_len)
                if matmul:
                    bias = self.chunk_bias(mask)
            prefills.append(PrefillChunk(starts[i], starts[i + 1], seq_len, tables[i], mask, matmul, bias))
        return prefills

    def matmul_path(self, device: torch.device, queries: int, keys: int) -> bool:
        """Whether a cached-prefix chunk runs as masked_chunk (CPU, in a measured window)."""
        return (device.type == "cpu" and MATMUL_MIN_QUERIES <= queries
                and queries * keys <= MATMUL_MAX_SCORES and onednn_available(torch.float32))

    def chunk_bias(self, mask: torch.Tensor) -> torch.Tensor | None:
        """What masked_chunk's softmax needs of the mask: here an additive 0 / -inf bias."""
        return torch.zeros(mask.shape, device=mask.device).masked_fill_(~mask, float("-inf"))

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                k_cache: torch.Tensor, v_cache: torch.Tensor,
                meta: TorchAttentionMeta, scale: float) -> torch.Tensor:
        hk, d = k_cache.shape[2], k_cache.shape[3]
        k_cache.view(-1, hk, d).index_copy_(0, meta.slot_mapping, k)       # (pages*page, Hk, D)
        v_cache.view(-1, hk, d).index_copy_(0, meta.slot_mapping, v)
        if not meta.prefills:
            return self._decode(q, k_cache, v_cache, meta, scale)
        out = torch.empty_like(q)                                           # (T, H, D)
        nd = meta.num_decodes
        if nd:
            out[:nd] = self._decode(q[:nd], k_cache, v_cache, meta, scale)
        for chunk in meta.prefills:
            out[chunk.start:chunk.end] = self._prefill(q[chunk.start:chunk.end], k_cache, v_cache,
                                                       chunk, scale)
        return out

    def _decode(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                meta: TorchAttentionMeta, scale: float) -> torch.Tensor:
        """q (Bd, H, D) -> (Bd, H, D): one SDPA per group of decode rows."""
        groups = meta.decode_groups
        if len(groups) == 1 and isinstance(groups[0].rows, slice):     # all rows, in order
            return self._attend_decodes(q, k_cache, v_cache, groups[0], scale)
        out = torch.empty_like(q)
        for group in groups:
            if isinstance(group.rows, slice):
                out[group.rows] = self._attend_decodes(q[group.rows], k_cache, v_cache, group, scale)
            else:
                rows = q.index_select(0, group.rows)                        # (n, H, D)
                out.index_copy_(0, group.rows, self._attend_decodes(rows, k_cache, v_cache, group, scale))
        return out

    def _attend_decodes(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        group: DecodeGroup, scale: float) -> torch.Tensor:
        """q (n, H, D), one query per sequence of the group -> (n, H, D)."""
        n, h, d = q.shape
        page_size, hk = k_cache.shape[1], k_cache.shape[2]
        tables = group.tables[:, :-(-group.length // page_size)]            # (n, P)
        keys = self.gather(0, k_cache, tables, group.length).transpose(1, 2)    # (n, Hk, L, D)
        values = self.gather(1, v_cache, tables, group.length).transpose(1, 2)  # (n, Hk, L, D)
        grouped = q.view(n, hk, h // hk, d)                                 # (n, Hk, G, D)
        out = F.scaled_dot_product_attention(grouped, keys, values, attn_mask=group.mask,
                                             scale=scale)                   # (n, Hk, G, D)
        return out.reshape(n, h, d)

    def masked_chunk(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                     chunk: PrefillChunk, scale: float) -> torch.Tensor:
        """A cached-prefix chunk's matmul path: q (Hk, G, L, D), keys / values (Hk, S, D)."""
        return masked_chunk_matmul(q, keys, values, onednn_scores, onednn_mix,
                                   functools.partial(scaled_masked_softmax, bias=chunk.bias, scale=scale))

    def _prefill(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 chunk: PrefillChunk, scale: float) -> torch.Tensor:
        """q (L, H, D) of one chunk -> (L, H, D)."""
        length, h, d = q.shape
        page_size, hk = k_cache.shape[1], k_cache.shape[2]
        g = h // hk
        pages = chunk.pages[None, :-(-chunk.seq_len // page_size)]          # (1, P)
        # Queries grouped by KV head; K/V broadcast over the group (stride 0, no copy).
        # SDPA gets 4-D inputs: with 3-D ones torch's CPU SDPA takes its slow math path.
        grouped = q.view(length, hk, g, d).permute(1, 2, 0, 3)              # (Hk, G, L, D)
        shape = (hk, g, chunk.seq_len, d)
        keys = self.gather(0, k_cache, pages, chunk.seq_len)[0].transpose(0, 1)[:, None].expand(shape)
        values = self.gather(1, v_cache, pages, chunk.seq_len)[0].transpose(0, 1)[:, None].expand(shape)
        if chunk.matmul and q.dtype == torch.float32:
            out = self.masked_chunk(grouped, keys[:, 0], values[:, 0], chunk, scale)
        elif chunk.mask is None:   # nothing cached: L == S, plain causal (SDPA skips masked blocks)
            out = F.scaled_dot_product_attention(grouped, keys, values, is_causal=True, scale=scale)
        else:
            out = F.scaled_dot_product_attention(grouped, keys, values, attn_mask=chunk.mask,
                                                 scale=scale)               # (Hk, G, L, D)
        return out.permute(2, 0, 1, 3).reshape(length, h, d)


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
