"""PagedAttention: the torch and cpu backends, one class composed of a decode strategy
(decode.py) and a cached-prefix chunk strategy (chunks.py).

    torch   GatheredDecode + OneDnnChunks   CPU and any GPU; the reference
    cpu     KernelDecode   + NativeChunks   CPU, float32 and bfloat16: the native kernels

Per layer:
1. Write the step's K/V: one index_copy_ of all T rows into the cache viewed as
   (num_pages * page_size, Hk, D), at batch.slot_mapping.
2. Decode rows (sequences [0, num_decodes), one query each) through the decode strategy.
3. Prefill chunk rows: one attention per sequence over its gathered pages. Where the chunk
   strategy has a native causal kernel (cpu, float32, AVX-512) every chunk without a window
   goes there; otherwise a chunk with nothing cached is plain causal SDPA, and one behind a
   cached prefix (or under a window) needs a mask, built once a step on first need
   (chunk_mask), and runs as SDPA with it or, inside the chunk strategy's window, as two
   matmuls and a softmax. Prefill is GEMM-bound, so the loop over sequences costs little here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from kvserve.model_service.attention.chunks import PrefillChunk
from kvserve.model_service.attention.decode import KernelDecodeMeta
from kvserve.model_service.attention.page_gather import PageGather, window_columns
from kvserve.model_service.batch import ForwardBatch


@dataclass(slots=True)
class PagedMeta:
    slot_mapping: torch.Tensor     # (T,) int64
    num_decodes: int
    decode: Any                    # the decode strategy's meta; None without decodes
    prefills: list[PrefillChunk]


@dataclass(slots=True)
class LayerMetas:
    """A step's meta for a model whose layers mask differently: the one layer i attends with."""
    metas: list[PagedMeta]

    def for_layer(self, i: int) -> PagedMeta:
        return self.metas[i]


class PagedAttention:
    window: int | None = None   # sliding window: a query at p sees keys p-W+1 .. p
    sinks: int = 0              # and the first `sinks` keys as well (attention sinks)

    page_size: int = 0          # needed with a window: the decode gathers only the window's pages
    layer_windows: tuple = ()   # a model mixing sliding and full layers: each layer's window

    def set_window(self, window: int | None, sinks: int = 0, page_size: int = 0,
                   layer_windows: tuple = ()) -> None:
        """window: every layer's; layer_windows: each layer's, when they differ."""
        if (window or any(layer_windows)) and not self.decode.windowed:
            raise RuntimeError(f"the {self.name} backend's decode kernel attends the whole context; a "
                               "sliding-window model runs on the torch backend")
        self.window, self.sinks, self.page_size = window, sinks, page_size
        self.layer_windows = layer_windows if window is None and any(layer_windows) else ()

    def __init__(self, name: str, decode, chunks, gather: PageGather) -> None:
        self.name = name
        self.decode = decode    # gathers, prepare(batch, tables) -> meta, (q, k_cache, v_cache, meta, scale) -> out
        self.chunks = chunks    # uses_matmul, bias, (q, keys, values, chunk, scale) -> out
        self.gather = gather    # the prefill's page gather (GatheredDecode shares it)

    def page_size_multiple(self) -> int:
        return 1

    def default_page_size(self) -> int:
        return 16

    def prepare(self, batch: ForwardBatch):
        nd = batch.num_decodes
        chunks = nd < batch.num_seqs
        # The page tables as int64 indices, made once a step for whoever gathers pages.
        tables = batch.block_tables.long() if chunks or (nd and self.decode.gathers) else None  # (B, max_pages)
        if self.layer_windows:   # one meta per kind of layer, sharing the tables
            window = next(w for w in self.layer_windows if w)
            full, windowed = self._prepare(batch, tables, None), self._prepare(batch, tables, window)
            return LayerMetas([windowed if w else full for w in self.layer_windows])
        return self._prepare(batch, tables, self.window)

    def _prepare(self, batch: ForwardBatch, tables: torch.Tensor | None, window: int | None) -> PagedMeta:
        nd = batch.num_decodes
        decode = self.decode.prepare(batch, tables, window, self.sinks, self.page_size) if nd else None
        prefills = self._prepare_prefills(batch, tables, window) if nd < batch.num_seqs else []
        return PagedMeta(batch.slot_mapping, nd, decode, prefills)

    def _prepare_prefills(self, batch: ForwardBatch, tables: torch.Tensor,
                          window: int | None) -> list[PrefillChunk]:
        """One chunk per sequence after the decodes: its rows, pages, and whether it needs a mask
        (chunk_mask builds it where a path asks)."""
        device = batch.input_ids.device
        prefills = []
        starts = batch.cu_seqlens_q.tolist()
        for i in range(batch.num_decodes, batch.num_seqs):
            seq_len, q_len = batch.seq_lens_cpu[i], batch.query_lens_cpu[i]
            slides = window if window is not None and seq_len > window else None
            masked = seq_len > q_len or slides is not None
            chunk = PrefillChunk(starts[i], starts[i + 1], seq_len, tables[i], masked, slides)
            if slides is not None:
                self._window_pages(chunk, q_len)
            chunk.matmul = masked and self.chunks.uses_matmul(device, q_len, chunk.keys)
            prefills.append(chunk)
        return prefills

    def _window_pages(self, chunk: PrefillChunk, q_len: int) -> None:
        """A windowed chunk gathers only the sinks' pages and those from its first query's window
        on: a stream with attention sinks, recomputed after a preemption, would otherwise gather
        and mask its whole history for every chunk."""
        ps, sink_pages = self.page_size, -(-self.sinks // self.page_size)
        first = max(0, chunk.seq_len - q_len - chunk.window + 1) // ps   # the first query's window's page
        if first <= sink_pages:
            return
        device = chunk.pages.device
        columns, chunk.key_positions = window_columns(sink_pages, first, -(-chunk.seq_len // ps), ps, device)
        chunk.pages = chunk.pages.index_select(0, columns)

    def chunk_mask(self, chunk: PrefillChunk) -> tuple[torch.Tensor, torch.Tensor | None]:
        """A masked chunk's (mask (L, S) bool, True = attend; the matmul path's bias or None), built
        on the first layer that asks and kept on the chunk for the step's other layers: query i at
        position cached + i sees keys up to it (within the window, and the sinks)."""
        if chunk.mask is None:
            q_pos = torch.arange(chunk.seq_len - (chunk.end - chunk.start), chunk.seq_len,
                                 device=chunk.pages.device)[:, None]                 # (L, 1)
            k_pos = (torch.arange(chunk.seq_len, device=chunk.pages.device) if chunk.key_positions is None
                     else chunk.key_positions)[None, :]                                     # (1, S)
            mask = k_pos <= q_pos                                                     # (L, S)
            if chunk.window is not None:
                mask &= (k_pos > q_pos - chunk.window) | (k_pos < self.sinks)
            chunk.mask, chunk.bias = mask, self.chunks.bias(mask) if chunk.matmul else None
        return chunk.mask, chunk.bias

    def decodes_natively(self) -> bool:
        return self.decode.native and not self.layer_windows

    def native_decode(self, meta) -> tuple[torch.Tensor, torch.Tensor] | None:
        if isinstance(meta, PagedMeta) and not meta.prefills and isinstance(meta.decode, KernelDecodeMeta):
            return meta.decode.tables, meta.decode.lens
        return None

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                k_cache: torch.Tensor, v_cache: torch.Tensor,
                meta: PagedMeta, scale: float) -> torch.Tensor:
        hk, d = k_cache.shape[2], k_cache.shape[3]
        # A cache narrower than the model (--kv-cache-dtype) takes each K/V rounded once; .to is a no-op else.
        k_cache.view(-1, hk, d).index_copy_(0, meta.slot_mapping, k.to(k_cache.dtype))   # (pages*page, Hk, D)
        v_cache.view(-1, hk, d).index_copy_(0, meta.slot_mapping, v.to(v_cache.dtype))
        if not meta.prefills:
            return self.decode(q, k_cache, v_cache, meta.decode, scale)
        out = torch.empty_like(q)                                           # (T, H, D)
        nd = meta.num_decodes
        if nd:
            out[:nd] = self.decode(q[:nd], k_cache, v_cache, meta.decode, scale)
        for chunk in meta.prefills:
            out[chunk.start:chunk.end] = self._prefill(q[chunk.start:chunk.end], k_cache, v_cache,
                                                       chunk, scale)
        return out

    def _prefill(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 chunk: PrefillChunk, scale: float) -> torch.Tensor:
        """q (L, H, D) of one chunk -> (L, H, D)."""
        length, h, d = q.shape
        page_size, hk = k_cache.shape[1], k_cache.shape[2]
        g = h // hk
        num_keys = chunk.keys
        pages = chunk.pages[None, :-(-num_keys // page_size)]               # (1, P)
        # Queries grouped by KV head; K/V broadcast over the group (stride 0, no copy).
        # SDPA gets 4-D inputs: with 3-D ones torch's CPU SDPA takes its slow math path.
        grouped = q.view(length, hk, g, d).permute(1, 2, 0, 3)              # (Hk, G, L, D)
        shape = (hk, g, num_keys, d)
        rows_k = self.gather(0, k_cache, pages, num_keys)[0]                # (S, Hk, D)
        rows_v = self.gather(1, v_cache, pages, num_keys)[0]
        if chunk.window is None:   # the native causal kernel, where built
            out = self.chunks.causal(q, rows_k, rows_v, chunk.seq_len - length, scale)
            if out is not None:
                return out
        keys = rows_k.to(q.dtype).transpose(0, 1)[:, None].expand(shape)
        values = rows_v.to(q.dtype).transpose(0, 1)[:, None].expand(shape)
        if not chunk.masked:   # nothing cached: L == S, plain causal (SDPA skips masked blocks)
            out = F.scaled_dot_product_attention(grouped, keys, values, is_causal=True, scale=scale)
        elif chunk.matmul and q.dtype == torch.float32:
            self.chunk_mask(chunk)   # the bias its softmax may need
            out = self.chunks(grouped, keys[:, 0], values[:, 0], chunk, scale)
        else:
            out = F.scaled_dot_product_attention(grouped, keys, values, attn_mask=self.chunk_mask(chunk)[0],
                                                 scale=scale)               # (Hk, G, L, D)
        return out.permute(2, 0, 1, 3).reshape(length, h, d)
