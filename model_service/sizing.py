"""How many KV pages to allocate.

CPU: a memory budget, --kv-cache-memory whole when it is given; by default 1 GiB, but never more
than max_num_seqs sequences of full model length fill (the tiny models would take thousands of
pages they cannot use).
CUDA: a profile run. Forward one worst-case batch (max_num_batched_tokens
prompt tokens, dummy_step.py) on a scratch cache, read the allocator's peak, and give
what --gpu-memory-utilization leaves of the device to pages.
"""

from __future__ import annotations

import logging

import torch

from kvserve.model_service.dummy_step import dummy_step
from kvserve.model_service.kv_cache import bytes_per_page, pages_for_memory

log = logging.getLogger(__name__)

CPU_DEFAULT_BYTES = 1 << 30


def cpu_pages(config, dtype: torch.dtype, page_size: int, budget: int | None,
              max_num_seqs: int, max_len: int, at_least: int = 0) -> int:
    """`at_least`: the pages the model needs whatever its length (a sliding window's), which the
    default's cap does not go below."""
    if budget is not None:   # asked for: more pages than running sequences fill keep more prefixes cached
        return budget_pages(config, dtype, page_size, budget)
    want = max(max_num_seqs * -(-max_len // page_size), at_least)
    return min(budget_pages(config, dtype, page_size, CPU_DEFAULT_BYTES), want)


def window_held(window: int, sinks: int, model_len: int) -> int:
    """The tokens whose pages one sequence of a sliding-window model may hold, beside its chunks:
    two windows. The pages it put in the prefix cache before its first slide (a window and a
    chunk; a prefix hit is no longer) stay, blocked by their own continuation, until the last of
    them has left the window behind it. Without sinks none holds more than the model length."""
    return 2 * window if sinks else min(2 * window, model_len)


def window_min_pages(window: int | None, sinks: int, model_len: int, page_size: int) -> int:
    """The fewest pages that serve a sliding-window model (0 for another): what one sequence holds,
    its sinks, and two chunks of at least a page."""
    if not window:
        return 0
    return -(-(window_held(window, sinks, model_len) + sinks + 6 * page_size) // page_size)


def budget_pages(config, dtype: torch.dtype, page_size: int, budget: int) -> int:
    """The whole pages --kv-cache-memory holds; a budget smaller than one page is refused."""
    pages = pages_for_memory(config, dtype, page_size, budget)
    if pages <= 0:
        raise ValueError(f"--kv-cache-memory {budget:,} B holds no KV page: one page of {page_size} tokens "
                         f"takes {bytes_per_page(config, dtype, page_size):,} bytes for this model")
    return pages


def cuda_pages(model, config, backend, dtype: torch.dtype, device: torch.device, page_size: int,
               max_num_batched_tokens: int, utilization: float, budget: int | None) -> int:
    """Pages that fit next to the weights and a worst-case step's activations."""
    if budget is not None:
        return budget_pages(config, dtype, page_size, budget)
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    dummy_step(model, config, backend, dtype, device, page_size, max_num_batched_tokens)
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device)
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    # Memory other processes hold counts against us too: take what is free, within our share.
    allowed = min(total * utilization - peak, free - (total * (1 - utilization)))
    pages = int(allowed // bytes_per_page(config, dtype, page_size))
    log.info("profile run: peak %.2f GiB of %.2f GiB; %d pages of %d tokens fit",
             peak / 2**30, total / 2**30, pages, page_size)
    if pages <= 0:
        raise ValueError(f"no room for KV pages: the profile run peaked at {peak / 2**30:.2f} GiB of "
                           f"{total / 2**30:.2f} GiB; raise --gpu-memory-utilization or lower "
                           "--max-num-batched-tokens")
    return pages
