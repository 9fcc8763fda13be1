"""One forward of a worst-case step on a scratch page pool: sizing's CUDA profile run and the
CPU warm-up both use it.

Worst case: one prompt of max_num_batched_tokens tokens, so every activation has its largest
shape. On CPU the warm-up leaves the heap at its working size (host_memory.py keeps it) and has
oneDNN build its kernels, so the first real request does not pay for either (docs/benchmarks.md
has what a cold first burst cost).
"""

from __future__ import annotations

import logging
import time

import torch

from kvserve.model_service.batch import ForwardBatch
from kvserve.model_service.kv_cache import KVCache

log = logging.getLogger(__name__)


def prompt_batch(tokens: int, page_size: int, device: torch.device) -> ForwardBatch:
    """One prompt of `tokens` tokens (ids 0) in pages 0, 1, 2, ... of its own pool."""
    n_pages = -(-tokens // page_size)
    return ForwardBatch(
        input_ids=torch.zeros(tokens, dtype=torch.int64, device=device),
        positions=torch.arange(tokens, device=device),
        slot_mapping=torch.arange(tokens, device=device),
        cu_seqlens_q=torch.tensor([0, tokens], dtype=torch.int32, device=device),
        seq_lens=torch.tensor([tokens], dtype=torch.int32, device=device),
        block_tables=torch.arange(n_pages, dtype=torch.int32, device=device)[None],
        logits_indices=torch.tensor([tokens - 1], device=device),
        num_decodes=0, max_seqlen_q=tokens, max_seqlen_k=tokens,
        query_lens_cpu=[tokens], seq_lens_cpu=[tokens])


@torch.inference_mode()
def dummy_step(model, config, backend, dtype: torch.dtype, device: torch.device,
               page_size: int, tokens: int) -> None:
    """Forwards one `tokens`-long prompt on a scratch cache of `dtype` (the KV pages'), freed on return."""
    scratch = KVCache(config, -(-tokens // page_size), page_size, dtype, device)
    batch = prompt_batch(tokens, page_size, device)
    model(batch, scratch.layers, backend, backend.prepare(batch))


def warm_up(model, config, backend, dtype: torch.dtype, device: torch.device,
            page_size: int, tokens: int) -> None:
    start = time.perf_counter()
    dummy_step(model, config, backend, dtype, device, page_size, tokens)
    log.info("warm-up step of %d tokens: %.2f s", tokens, time.perf_counter() - start)
