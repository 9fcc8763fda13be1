"""How many KV pages to allocate.

CPU: a memory budget (--kv-cache-memory, default 1 GiB), never more than
max_num_seqs sequences of full model length need.
CUDA: a profile run. Forward one worst-case batch (max_num_batched_tokens
prompt tokens) with a one-page cache, read the allocator's peak, and give
what --gpu-memory-utilization leaves of the device to pages.
"""

from __future__ import annotations

import logging

import torch

from model_service.kv_cache import bytes_per_page, pages_for_memory

log = logging.getLogger(__name__)

CPU_DEFAULT_BYTES = 1 << 30


def cpu_pages(config, dtype: torch.dtype, page_size: int, budget: int | None,
              max_num_seqs: int, max_len: int) -> int:
    want = max_num_seqs * -(-max_len // page_size)
    return max(1, min(pages_for_memory(config, dtype, page_size, budget or CPU_DEFAULT_BYTES), want))


@torch.inference_mode()
def cuda_pages(model, config, backend, dtype: torch.dtype, device: torch.device, page_size: int,
               max_num_batched_tokens: int, utilization: float, budget: int | None) -> int:
    """Pages that fit next to the weights and a worst-case step's activations."""
    from model_service.batch import ForwardBatch
    from model_service.kv_cache import KVCache

    if budget is not None:
        return pages_for_memory(config, dtype, page_size, budget)
    tokens = max_num_batched_tokens
    n_pages = -(-tokens // page_size)
    scratch = KVCache(config, n_pages, page_size, dtype, device)
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    batch = ForwardBatch(
        input_ids=torch.zeros(tokens, dtype=torch.int64, device=device),
        positions=torch.arange(tokens, device=device),
        slot_mapping=torch.arange(tokens, device=device),
        cu_seqlens_q=torch.tensor([0, tokens], dtype=torch.int32, device=device),
        seq_lens=torch.tensor([tokens], dtype=torch.int32, device=device),
        block_tables=torch.arange(n_pages, dtype=torch.int32, device=device)[None],
        logits_indices=torch.tensor([tokens - 1], device=device),
        num_decodes=0, max_seqlen_q=tokens, max_seqlen_k=tokens,
        query_lens_cpu=[tokens], seq_lens_cpu=[tokens])
    model(batch, scratch.layers, backend, backend.prepare(batch))
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device)
    del scratch
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    # Memory other processes hold counts against us too: take what is free, within our share.
    allowed = min(total * utilization - peak, free - (total * (1 - utilization)))
    pages = int(allowed // bytes_per_page(config, dtype, page_size))
    log.info("profile run: peak %.2f GiB of %.2f GiB; %d pages of %d tokens fit",
             peak / 2**30, total / 2**30, pages, page_size)
    if pages <= 0:
        raise RuntimeError(f"no room for KV pages: the profile run peaked at {peak / 2**30:.2f} GiB of "
                           f"{total / 2**30:.2f} GiB; raise --gpu-memory-utilization or lower "
                           "--max-num-batched-tokens")
    return pages
