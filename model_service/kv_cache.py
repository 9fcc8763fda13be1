"""The KV cache's bytes: device page tensors and the CPU swap space.

The manager (kvcache_service) decides which page goes where; this class only
executes the copies it plans. All layers' K and V live in ONE tensor per pool:

    device: (2, num_layers, num_pages, page_size, num_kv_heads, head_dim)
    cpu:    (2, num_layers, cpu_pages, page_size, num_kv_heads, head_dim)   pinned on CUDA
             └ 0 = K, 1 = V

so that `layers[i] = (pool[0, i], pool[1, i])` is the (num_pages, page_size,
Hk, D) layout every attention backend reads (attention/base.py), and a list of
page copies is ONE index_select along the page dim plus ONE index_copy_, for
every layer at once: no per-page or per-layer Python loop.

A spare page (spare_page=True) sits past the last page the manager hands out: the rows that pad
a decode batch to a captured CUDA graph's size write their K/V there (engine/decode_graphs.py).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvserve.model_service.host_memory import huge_page_zeros
from kvserve.model_service.model.config import ModelConfig

PagePairs = Sequence[tuple[int, int]]   # (src page id, dst page id)
_PAGE_DIM = 2


def bytes_per_token(config: ModelConfig, dtype: torch.dtype) -> int:
    """K and V of one token in every layer."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    return 2 * config.num_layers * config.num_kv_heads * config.head_dim * itemsize


def bytes_per_page(config: ModelConfig, dtype: torch.dtype, page_size: int) -> int:
    return page_size * bytes_per_token(config, dtype)


def pages_for_memory(config: ModelConfig, dtype: torch.dtype, page_size: int, nbytes: int) -> int:
    """How many whole pages fit in `nbytes`."""
    return max(0, nbytes) // bytes_per_page(config, dtype, page_size)


class KVCache:
    def __init__(self, config: ModelConfig, num_pages: int, page_size: int,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                 cpu_pages: int = 0, spare_page: bool = False) -> None:
        if num_pages <= 0 or page_size <= 0 or cpu_pages < 0:
            raise ValueError(f"need num_pages > 0, page_size > 0, cpu_pages >= 0; got "
                             f"{num_pages}, {page_size}, {cpu_pages}")
        self.device = torch.device(device)
        self.page_size = page_size
        page_shape = (page_size, config.num_kv_heads, config.head_dim)
        self.spare_page = num_pages if spare_page else None   # its id: one no sequence's table names
        shape = (2, config.num_layers, num_pages + spare_page, *page_shape)
        # On CPU on huge pages: a decode step reads pages all over the pool (host_memory.py).
        self.pool = (huge_page_zeros(shape, dtype) if self.device.type == "cpu"
                     else torch.zeros(shape, dtype=dtype, device=self.device))
        self.cpu_pool = torch.zeros(2, config.num_layers, cpu_pages, *page_shape, dtype=dtype,
                                    pin_memory=self.device.type == "cuda" and cpu_pages > 0)
        # Per layer (k_cache, v_cache), each (num_pages, page_size, Hk, D): views of pool.
        self.layers = [(self.pool[0, i], self.pool[1, i]) for i in range(config.num_layers)]

    @property
    def num_pages(self) -> int:
        """The pages the manager hands out (the spare page is not one)."""
        return self.pool.shape[_PAGE_DIM] - (self.spare_page is not None)

    @property
    def num_cpu_pages(self) -> int:
        return self.cpu_pool.shape[_PAGE_DIM]

    def execute(self, plan) -> None:
        """A step plan's copies (kvcache_service.contract.types.StepPlan), in the order the
        manager plans them so that every copy reads before anything overwrites its source:
        swap_out (device -> CPU), copies (device -> device), swap_in (CPU -> device)."""
        self.swap_out(plan.swap_out)
        self.copy(plan.copies)
        self.swap_in(plan.swap_in)

    def swap_out(self, pairs: PagePairs) -> None:
        """Device page -> CPU page, for each (src device page, dst cpu page)."""
        if pairs:
            src, dst = self._indices(pairs, self.device, torch.device("cpu"))
            moved = self.pool.index_select(_PAGE_DIM, src).to("cpu")   # (2, layers, n, page, Hk, D)
            self.cpu_pool.index_copy_(_PAGE_DIM, dst, moved)

    def swap_in(self, pairs: PagePairs) -> None:
        """CPU page -> device page, for each (src cpu page, dst device page)."""
        if pairs:
            src, dst = self._indices(pairs, torch.device("cpu"), self.device)
            moved = self.cpu_pool.index_select(_PAGE_DIM, src).to(self.device)
            self.pool.index_copy_(_PAGE_DIM, dst, moved)

    def copy(self, pairs: PagePairs) -> None:
        """Device page -> device page (copy-on-write), in list order as the manager plans them.

        One batched copy when no page is written and then read, nor written twice (the usual
        case; index_copy_ leaves a page written twice undefined); otherwise pair by pair, so that
        in a chain such as (a -> b), (b -> c) c gets a, and a page written twice keeps the last."""
        if not pairs:
            return
        written = {d for _, d in pairs}
        if len(written) == len(pairs) and written.isdisjoint(s for s, _ in pairs):
            src, dst = self._indices(pairs, self.device, self.device)
            self.pool.index_copy_(_PAGE_DIM, dst, self.pool.index_select(_PAGE_DIM, src))
            return
        for s, d in pairs:
            self.pool[:, :, d].copy_(self.pool[:, :, s])

    @staticmethod
    def _indices(pairs: PagePairs, src_device: torch.device,
                 dst_device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        both = torch.tensor(pairs, dtype=torch.int64)                  # (n, 2)
        return both[:, 0].to(src_device), both[:, 1].to(dst_device)
