"""PageGather: a batch's pages copied into reused buffers, one for K and one for V."""

from __future__ import annotations

import torch


class PageGather:
    """The gathered K/V of a layer live only until its attention returns, so every layer
    (and every step) can reuse the same memory: a fresh multi-MB tensor per gather would
    page-fault (docs/benchmarks.md). The buffers grow to the largest step seen and stay."""

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
        # index_select on the flattened table: faster than cache[tables] on CPU.
        torch.index_select(cache, 0, tables.reshape(-1), out=rows)
        return rows.view(b, p * page_shape[0], *page_shape[1:])[:, :length]


def window_columns(sink_pages: int, first: int, pages: int, page_size: int,
                   device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """A sliding window's page columns, the sinks' then `first` .. `pages` - 1, and the positions
    of their keys ((C,) int64 and (C * page_size,) int64)."""
    columns = torch.cat([torch.arange(sink_pages, device=device), torch.arange(first, pages, device=device)])
    return columns, (columns[:, None] * page_size + torch.arange(page_size, device=device)).reshape(-1)
