"""One step's packed varlen batch: every token of every sequence in one dimension (TND).

Sequences come decodes first (exactly one query token each), then prefill
chunks. An example with page_size 4, two decodes and two prefill chunks:

    tokens        [ d0 | d1 | p0 p0 p0 p0 p0 | p1 p1 ]           T = 9 rows
    cu_seqlens_q  [0, 1, 2, 7, 9]                                 B + 1 entries
    seq_lens      [6, 3, 9, 2]      context length after this step (cached + new)
    positions     [5 | 2 | 4 5 6 7 8 | 0 1]

    page table of p0: [7, 2, 9]  →  position 6 lives in page 2 (6 // 4 = 1 → table[1]),
                                    slot 2 * 4 + 6 % 4 = 10
    slot_mapping  one flat slot per token: table[pos // page_size] * page_size + pos % page_size
    block_tables  (B, max_pages) int32, rows padded with 0 (never read past seq_lens)

logits_indices picks the rows whose logits are sampled: each decode row, and
the last row of a prefill chunk that reaches the end of its prompt.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True)
class ForwardBatch:
    input_ids: torch.Tensor       # (T,) int64
    positions: torch.Tensor       # (T,) int64
    slot_mapping: torch.Tensor    # (T,) int64
    cu_seqlens_q: torch.Tensor    # (B+1,) int32
    seq_lens: torch.Tensor        # (B,) int32
    block_tables: torch.Tensor    # (B, max_pages) int32
    logits_indices: torch.Tensor  # (S,) int64
    num_decodes: int              # sequences [0, num_decodes) have one query token each
    max_seqlen_q: int
    max_seqlen_k: int
    query_lens_cpu: list[int]     # host copies, for backends that loop over sequences
    seq_lens_cpu: list[int]

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[0]

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)
