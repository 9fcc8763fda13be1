"""Test helpers: sequences on shuffled pages, and ForwardBatch building from them.

The engine will build its own batches; this is the small, readable version the
model tests and the model benchmark share.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import torch

from kvserve.model_service.batch import ForwardBatch


class PagePool:
    """Hands out page ids in a shuffled order, so page tables are never contiguous."""

    def __init__(self, num_pages: int, seed: int = 0) -> None:
        self.free = list(range(num_pages))
        random.Random(seed).shuffle(self.free)

    def take(self, n: int) -> list[int]:
        if n > len(self.free):
            raise RuntimeError(f"out of pages: need {n}, have {len(self.free)}")
        taken, self.free = self.free[:n], self.free[n:]
        return taken


@dataclass
class Sequence:
    tokens: list[int]                 # every token so far (prompt + generated)
    computed: int = 0                 # tokens whose K/V are in the cache
    pages: list[int] = field(default_factory=list)

    def reserve(self, pool: PagePool, page_size: int, upto: int) -> None:
        need = -(-upto // page_size) - len(self.pages)
        if need > 0:
            self.pages += pool.take(need)


@dataclass
class Chunk:
    seq: Sequence
    num_tokens: int                   # tokens to compute this step, from seq.computed on
    logits: bool = True               # sample logits at this chunk's last row


def build_batch(chunks: list[Chunk], num_decodes: int, pool: PagePool, page_size: int,
                device: str | torch.device = "cpu") -> ForwardBatch:
    """One step over `chunks` (decodes first). Reserves pages; does not advance `computed`."""
    input_ids, positions, slots, q_lens, seq_lens, logit_rows = [], [], [], [], [], []
    for chunk in chunks:
        seq = chunk.seq
        start, end = seq.computed, seq.computed + chunk.num_tokens
        seq.reserve(pool, page_size, end)
        input_ids += seq.tokens[start:end]
        positions += range(start, end)
        slots += [seq.pages[p // page_size] * page_size + p % page_size for p in range(start, end)]
        q_lens.append(chunk.num_tokens)
        seq_lens.append(end)
        if chunk.logits:
            logit_rows.append(len(input_ids) - 1)
    max_pages = max(len(c.seq.pages) for c in chunks)
    tables = [c.seq.pages + [0] * (max_pages - len(c.seq.pages)) for c in chunks]
    cu = [0]
    for n in q_lens:
        cu.append(cu[-1] + n)

    def t(values: list[int], dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype, device=device)

    return ForwardBatch(
        input_ids=t(input_ids, torch.int64), positions=t(positions, torch.int64),
        slot_mapping=t(slots, torch.int64), cu_seqlens_q=t(cu, torch.int32),
        seq_lens=t(seq_lens, torch.int32),
        block_tables=torch.tensor(tables, dtype=torch.int32, device=device),
        logits_indices=t(logit_rows, torch.int64), num_decodes=num_decodes,
        max_seqlen_q=max(q_lens), max_seqlen_k=max(seq_lens),
        query_lens_cpu=q_lens, seq_lens_cpu=seq_lens)


def advance(chunks: list[Chunk]) -> None:
    for chunk in chunks:
        chunk.seq.computed += chunk.num_tokens
