"""A request's tokens as one int64 tensor, for the penalties.

A penalised row needs its prompt and output ids each step. Converted from the request's Python
list every step, they cost each step time linear in the history, so a request's steps cost the
square of its length (hundreds of ms a step at a million tokens, which attention sinks allow).
A request's tokens are only ever appended, so a TokenHistory converts just the new ones, into a
buffer that doubles as it fills, and hands out views.
"""

from __future__ import annotations

import torch


class TokenHistory:
    def __init__(self, num_prompt: int) -> None:
        self.num_prompt = num_prompt
        self._ids = torch.empty(0, dtype=torch.int64)
        self._count = 0   # tokens converted so far

    def sync(self, tokens: list[int]) -> None:
        """Takes in the tokens appended to `tokens` since the last call."""
        count = len(tokens)
        if count < self._count:
            raise ValueError(f"a token history only grows: {count} tokens after {self._count}")
        if count > len(self._ids):
            grown = torch.empty(max(count, 2 * len(self._ids)), dtype=torch.int64)
            grown[:self._count] = self._ids[:self._count]
            self._ids = grown
        if count > self._count:
            self._ids[self._count:count] = torch.tensor(tokens[self._count:count], dtype=torch.int64)
            self._count = count

    @property
    def prompt(self) -> torch.Tensor:
        return self._ids[:min(self.num_prompt, self._count)]

    @property
    def output(self) -> torch.Tensor:
        return self._ids[self.num_prompt:self._count]

    def output_then(self, more: list[int]) -> torch.Tensor:
        """The output ids and `more` after them (a draft's tokens before a position)."""
        return torch.cat([self.output, torch.tensor(more, dtype=torch.int64)])
