"""A decode-only step's inputs as two host tensors: what the eager runner moves to the device
(runner.py) and what a CUDA graph's static buffers are refilled from (decode_graphs.py)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvserve.model_service.engine.scheduler import Work


@dataclass(frozen=True, slots=True)
class DecodeInputs:
    """rows = len(work) + pad rows. longs (int64): [ids | positions | slots | sampled rows];
    ints (int32): [cu_seqlens_q | seq_lens | page tables, rows x width]."""
    longs: torch.Tensor
    ints: torch.Tensor
    rows: int
    width: int
    seq_lens: list[int]   # the real rows'

    def ids(self) -> torch.Tensor:
        return self.longs[:self.rows]

    def positions(self) -> torch.Tensor:
        return self.longs[self.rows:2 * self.rows]

    def slots(self) -> torch.Tensor:
        return self.longs[2 * self.rows:3 * self.rows]

    def sampled(self) -> torch.Tensor:
        return self.longs[3 * self.rows:]

    def cu_seqlens_q(self) -> torch.Tensor:
        return self.ints[:self.rows + 1]

    def lens(self) -> torch.Tensor:
        return self.ints[self.rows + 1:2 * self.rows + 1]

    def tables(self) -> torch.Tensor:
        return self.ints[2 * self.rows + 1:].view(self.rows, self.width)


def decode_inputs(work: list[Work], page_size: int, pad: int = 0, pad_page: int = 0) -> DecodeInputs:
    """One token per item (no draft). `pad` more rows after the real ones: token 0 at position 0,
    its slot the first of `pad_page`, a table naming only that page; short tables are filled
    with `pad_page` too (never read past a row's length)."""
    ps = page_size
    starts = [w.start for w in work]
    seq_lens = [s + 1 for s in starts]
    width = -(-max(seq_lens) // ps)
    tables = [w.request.page_table[:width] for w in work]
    slots = [t[s // ps] * ps + s % ps for t, s in zip(tables, starts)]
    samples = [i for i, w in enumerate(work) if w.samples]
    longs = torch.tensor([w.request.tokens[w.start] for w in work] + [0] * pad + starts + [0] * pad
                         + slots + [pad_page * ps] * pad + samples, dtype=torch.int64)
    rows = len(work) + pad
    ints = torch.tensor([*range(rows + 1), *seq_lens, *[1] * pad,
                         *(p for t in tables for p in t + [pad_page] * (width - len(t))), *[pad_page] * (width * pad)],
                        dtype=torch.int32)
    return DecodeInputs(longs, ints, rows, width, seq_lens)
