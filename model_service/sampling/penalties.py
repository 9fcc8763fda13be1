"""Repetition, presence and frequency penalties, applied to some rows of a batch in one pass.

Repetition (HF `RepetitionPenaltyLogitsProcessor`): over the prompt *and* output tokens, a seen
token's logit becomes logit / p when positive and logit * p otherwise.
Presence / frequency (OpenAI): over the output tokens only,
logit -= presence * (count > 0) + frequency * count.
Repetition is applied first, then presence / frequency (the order of vLLM's `apply_penalties`).

Only the logits of tokens in a row's history can change, so the work is a gather, a few
elementwise ops and a scatter over the (R, L) history ids rather than passes over (R, V):

    ids     row 0: [p p p o o | pad pad]      pad = the row's first id: a duplicate id computes
            row 1: [p o o o o   o   o  ]      the same new value, so the scatter stays exact
    counts  (R, V+1) output-token counts; output rows are padded with V, the extra column
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

TokenIds = Sequence[int] | torch.Tensor


def apply_penalties(
    logits: torch.Tensor,              # (S, V) float32, modified in place
    rows: torch.Tensor,                # (R,) int64: the rows to penalise
    prompt_ids: Sequence[TokenIds],    # R
    output_ids: Sequence[TokenIds],    # R
    repetition: torch.Tensor,          # (R,) float32; 1.0 = off
    presence: torch.Tensor,            # (R,) float32; 0.0 = off
    frequency: torch.Tensor,           # (R,) float32; 0.0 = off
) -> None:
    vocab, device = logits.shape[1], logits.device
    prompts = [_as_ids(r) for r in prompt_ids]
    outputs = [_as_ids(r) for r in output_ids]
    ids, has_ids = _padded_history(prompts, outputs, device)             # (R, L), (R,)
    if ids.shape[1] == 0:
        return
    counts = _output_counts(outputs, len(rows), vocab, device)           # (R, V+1)
    row_ix = rows.unsqueeze(1)                                            # (R, 1)
    old = logits[row_ix, ids]                                             # (R, L)
    count = counts.gather(1, ids)                                         # (R, L)
    p = repetition.unsqueeze(1)                                           # (R, 1)
    new = torch.where(old > 0, old / p, old * p)                          # every id here was seen
    new -= presence.unsqueeze(1) * (count > 0) + frequency.unsqueeze(1) * count
    # A row without any history points at id 0 and writes its logit back unchanged.
    logits[row_ix, ids] = torch.where(has_ids.unsqueeze(1), new, old)


def _as_ids(row: TokenIds) -> torch.Tensor:
    return torch.as_tensor(row, dtype=torch.int64).reshape(-1)


def _padded_history(
    prompts: list[torch.Tensor], outputs: list[torch.Tensor], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    history = [torch.cat([p, o]) for p, o in zip(prompts, outputs)]
    lengths = torch.tensor([len(h) for h in history])                    # (R,)
    ids = torch.nn.utils.rnn.pad_sequence(history, batch_first=True)     # (R, L) zero-padded
    pad = torch.arange(ids.shape[1]).unsqueeze(0) >= lengths.unsqueeze(1)  # (R, L)
    ids = torch.where(pad, ids[:, :1], ids)                              # pad with the first id
    return ids.to(device, non_blocking=True), (lengths > 0).to(device, non_blocking=True)


def _output_counts(
    outputs: list[torch.Tensor], num_rows: int, vocab: int, device: torch.device
) -> torch.Tensor:  # (R, V+1) float32: how often each id occurs in each row's output
    padded = torch.nn.utils.rnn.pad_sequence(outputs, batch_first=True, padding_value=vocab)
    padded = padded.to(device, non_blocking=True)                        # (R, Lo)
    counts = torch.zeros(num_rows, vocab + 1, dtype=torch.float32, device=device)
    return counts.scatter_add_(1, padded, torch.ones_like(padded, dtype=torch.float32))
