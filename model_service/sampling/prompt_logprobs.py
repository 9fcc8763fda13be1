"""A prompt's own logprobs: each prompt token's log-probability given the tokens before it, and
the top-n at its position, from the raw logits of the position before it (no penalties, no
temperature: the model's distribution, as vLLM's prompt_logprobs are)."""

from __future__ import annotations

import torch

from kvserve.model_service.sampling.sampler import TokenLogprobs

ROWS_AT_ONCE = 256   # log_softmax's float32 copy of a chunk's logits, a block of rows at a time


def prompt_logprobs(logits: torch.Tensor, targets: list[int], top: int) -> list[TokenLogprobs]:
    """logits (R, V), row i the position before targets[i]; `top` alternatives per position."""
    out: list[TokenLogprobs] = []
    k = min(top, logits.shape[1])
    for lo in range(0, len(targets), ROWS_AT_ONCE):
        block = torch.log_softmax(logits[lo:lo + ROWS_AT_ONCE].float(), dim=-1)              # (r, V)
        ids = torch.tensor(targets[lo:lo + ROWS_AT_ONCE], dtype=torch.int64, device=block.device)
        chosen = block.gather(1, ids.unsqueeze(1)).squeeze(1).tolist()                     # (r,)
        if k:
            top_vals, top_ids = block.topk(k, dim=-1)                                      # (r, k)
            tops = [list(zip(i, v)) for i, v in zip(top_ids.tolist(), top_vals.tolist())]
        else:
            tops = [[] for _ in chosen]
        out.extend(TokenLogprobs(t, lp, alternatives) for t, lp, alternatives in zip(ids.tolist(), chosen, tops))
    return out
