"""Decode attention on pages: one query per sequence, two ways behind one shape.

    gathers                              whether prepare needs the int64 page tables
    native                               whether its meta hands the pages to a fused layer
    prepare(batch, tables) -> meta       once per step (with decodes), shared by every layer
    __call__(q, k_cache, v_cache, meta, scale) -> out      q, out (Bd, H, D)

GatheredDecode (torch; CPU and any GPU): the rows' pages gathered by page table, one SDPA per
group of rows of similar context length (decode_groups):

    keys    k_cache[block_tables[rows, :P]]  (n, P, page, Hk, D) -> (n, Hk, L, D)
    queries q[rows]                          (n, H, D) -> (n, Hk, G, D)
    mask    key index < seq_len              (n, 1, 1, L), built once per step

G = H / Hk query heads share each KV head; grouping the queries by KV head puts the G queries
in SDPA's query-length slot, so K/V are never repeated. One call for all rows would gather and
attend every row up to the longest context; a few groups of sorted lengths cut that work. The
scheduler sends decodes longest first, so each group is a row range, sliced; rows in any other
order are indexed.

KernelDecode (the cpu backend; float32 or bfloat16, and float32 queries over bfloat16 pages):
kernels/paged_decode.c reads each page once, straight from the cache, with an online softmax,
one OpenMP task per sequence.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvserve.model_service.attention.page_gather import PageGather, window_columns
from kvserve.model_service.batch import ForwardBatch
from kvserve.model_service.kernels.paged_decode import PagedDecodeKernel

ROWS_PER_DECODE_GROUP = 8   # fewer rows than this per group: the extra calls cost more than they save
MAX_DECODE_GROUPS = 4       # the best measured at 32 decodes (docs/benchmarks.md)


def decode_groups(seq_lens: list[int]) -> list[list[int]]:
    """Decode rows split into groups of similar context length, longest first."""
    count = min(MAX_DECODE_GROUPS, len(seq_lens) // ROWS_PER_DECODE_GROUP)
    if count <= 1:
        return [list(range(len(seq_lens)))]
    order = sorted(range(len(seq_lens)), key=seq_lens.__getitem__, reverse=True)
    size = -(-len(order) // count)
    return [order[i:i + size] for i in range(0, len(order), size)]


@dataclass(slots=True)
class DecodeGroup:
    rows: torch.Tensor | slice  # (n,) int64 decode rows, longest context first; or a range of them
    tables: torch.Tensor       # (n, P) int64 page ids, P = pages of the longest context
    length: int                # the longest context in the group
    mask: torch.Tensor | None  # (n, 1, 1, length) bool, True = attend; None: all are `length` long
    skip: int = 0              # keys gathered before the first one attended (a window's first page)


class GatheredDecode:
    gathers = True
    native = False
    windowed = True   # takes a sliding window (and sinks) through its mask

    def __init__(self, gather: PageGather) -> None:
        self.gather = gather

    def prepare(self, batch: ForwardBatch, tables: torch.Tensor, window: int | None = None,
                sinks: int = 0, page_size: int = 0) -> list[DecodeGroup]:
        """tables: (B, max_pages) int64."""
        return [_decode_group(batch, tables, rows, window, sinks, page_size)
                for rows in decode_groups(batch.seq_lens_cpu[:batch.num_decodes])]

    def __call__(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 groups: list[DecodeGroup], scale: float) -> torch.Tensor:
        """q (Bd, H, D) -> (Bd, H, D): one SDPA per group of decode rows."""
        if len(groups) == 1 and isinstance(groups[0].rows, slice):     # all rows, in order
            return self._attend(q, k_cache, v_cache, groups[0], scale)
        out = torch.empty_like(q)
        for group in groups:
            if isinstance(group.rows, slice):
                out[group.rows] = self._attend(q[group.rows], k_cache, v_cache, group, scale)
            else:
                rows = q.index_select(0, group.rows)                        # (n, H, D)
                out.index_copy_(0, group.rows, self._attend(rows, k_cache, v_cache, group, scale))
        return out

    def _attend(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                group: DecodeGroup, scale: float) -> torch.Tensor:
        """q (n, H, D), one query per sequence of the group -> (n, H, D)."""
        n, h, d = q.shape
        page_size, hk = k_cache.shape[1], k_cache.shape[2]
        end = group.skip + group.length
        tables = group.tables[:, :-(-end // page_size)]                     # (n, P)
        # Pages narrower than q (--kv-cache-dtype) widened for SDPA; .to is a no-op else.
        keys = self.gather(0, k_cache, tables, end)[:, group.skip:].to(q.dtype).transpose(1, 2)    # (n, Hk, L, D)
        values = self.gather(1, v_cache, tables, end)[:, group.skip:].to(q.dtype).transpose(1, 2)  # (n, Hk, L, D)
        grouped = q.view(n, hk, h // hk, d)                                 # (n, Hk, G, D)
        out = F.scaled_dot_product_attention(grouped, keys, values, attn_mask=group.mask,
                                             scale=scale)                   # (n, Hk, G, D)
        return out.reshape(n, h, d)


def _decode_group(batch: ForwardBatch, tables: torch.Tensor, rows: list[int], window: int | None = None,
                  sinks: int = 0, page_size: int = 0) -> DecodeGroup:
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
    if window is not None and length > window:
        return _windowed_group(index, group_tables, group_lens, min(lens), length, window, sinks, page_size)
    mask = None
    if min(lens) != length:
        key_idx = torch.arange(length, device=device)
        mask = (key_idx[None, :] < group_lens[:, None])[:, None, None, :]     # (n, 1, 1, L)
    return DecodeGroup(index, group_tables, length, mask)


def _windowed_group(index, tables: torch.Tensor, lens: torch.Tensor, shortest: int, length: int,
                    window: int, sinks: int, ps: int) -> DecodeGroup:
    """A sliding window: only the pages a row's window (or the sinks) reaches are gathered, so a
    step costs the window, not the whole context. A query at len - 1 sees keys len - W .. len - 1
    and the first `sinks`."""
    device = tables.device
    pages = -(-length // ps)
    if shortest == length and not sinks:   # rows of one length: exactly the window, no mask
        start = length - window
        return DecodeGroup(index, tables[:, start // ps:pages], window, None, start % ps)
    sink_pages = -(-sinks // ps)
    first = max(0, shortest - window) // ps          # the first page any row's window reaches
    shared = pages - first + sink_pages if first > sink_pages else pages   # the columns gathered below
    own = sink_pages + -(-(window - 1) // ps) + 1    # the most pages one row's sinks and window span
    if own < shared:   # lengths far apart (a long stream beside short ones): each row its own pages
        return _own_pages_group(index, tables, lens, window, sinks, sink_pages, own - sink_pages, ps)
    if first > sink_pages:
        columns, key_pos = window_columns(sink_pages, first, pages, ps, device)   # (C,), (C*ps,)
        tables = tables.index_select(1, columns)                                  # (n, C)
    else:
        _, key_pos = window_columns(0, 0, pages, ps, device)
        tables = tables[:, :pages]
    return DecodeGroup(index, tables, key_pos.numel(), _visible(key_pos[None, :], lens, window, sinks))


def _own_pages_group(index, tables: torch.Tensor, lens: torch.Tensor, window: int, sinks: int,
                     sink_pages: int, window_pages: int, ps: int) -> DecodeGroup:
    """Each row gathers its sink pages, then `window_pages` pages from its window's first (never
    one of the sinks' again); columns past the table read its last column, masked."""
    device = tables.device
    first = ((lens.long() - window) // ps).clamp(min=sink_pages)                     # (n,)
    columns = torch.cat([torch.arange(sink_pages, device=device).expand(len(first), sink_pages),
                         first[:, None] + torch.arange(window_pages, device=device)], dim=1)  # (n, C)
    own = tables.gather(1, columns.clamp(max=tables.shape[1] - 1))                  # (n, C)
    key_pos = (columns[:, :, None] * ps + torch.arange(ps, device=device)).reshape(len(first), -1)  # (n, C*ps)
    return DecodeGroup(index, own, key_pos.shape[1], _visible(key_pos, lens, window, sinks))


def _visible(key_pos: torch.Tensor, lens: torch.Tensor, window: int, sinks: int) -> torch.Tensor:
    """(n, 1, 1, K) bool: which keys each row's query sees, key_pos (1 or n, K) their positions."""
    visible = key_pos < lens[:, None]
    visible &= (key_pos >= lens[:, None] - window) | (key_pos < sinks)
    return visible[:, None, None, :]


@dataclass(slots=True)
class KernelDecodeMeta:
    tables: torch.Tensor   # (num_decodes, max_pages) int32, rows contiguous
    lens: torch.Tensor     # (num_decodes,) int32
    max_len: int           # the longest of lens


class KernelDecode:
    gathers = False   # the kernel reads the int32 tables as they are
    native = True     # and so may a fused decode layer (kernels/decode_layer.py)
    windowed = False  # the kernel attends every key up to the sequence's length

    def __init__(self, kernel: PagedDecodeKernel) -> None:
        self.kernel = kernel

    def prepare(self, batch: ForwardBatch, tables: torch.Tensor | None, window: int | None = None,
                sinks: int = 0, page_size: int = 0) -> KernelDecodeMeta:
        nd = batch.num_decodes
        return KernelDecodeMeta(batch.block_tables[:nd].contiguous(), batch.seq_lens[:nd].contiguous(),
                                max(batch.seq_lens_cpu[:nd], default=0))

    def __call__(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 meta: KernelDecodeMeta, scale: float) -> torch.Tensor:
        return self.kernel(q, k_cache, v_cache, meta.tables, meta.lens, scale, meta.max_len)
