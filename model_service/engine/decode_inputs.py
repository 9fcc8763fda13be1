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
    tables = [w.request.page_table[:-(-n // ps)] for w, n in zip(work, seq_lens)]
    slots = [t[s // ps] * ps + s % ps for t, s in zip(tables, starts)]
    samples = [i for i, w in enumerate(work) if w.samples]
    longs = torch.tensor([w.request.tokens[w.start] for w in work] + [0] * pad + starts + [0] * pad
                         + slots + [pad_page * ps] * pad + samples, dtype=torch.int64)
    rows = len(work) + pad
    head = [*range(rows + 1), *seq_lens, *[1] * pad]
    if mostly_filled(tables, width):   # the common step: one list, one tensor
        ints = torch.tensor([*head, *(p for t in tables for p in t + [pad_page] * (width - len(t))),
                             *[pad_page] * (width * pad)], dtype=torch.int32)
    else:
        ints = torch.full((len(head) + rows * width,), pad_page, dtype=torch.int32)
        ints[:len(head)] = torch.tensor(head, dtype=torch.int32)
        _fill(ints[len(head):len(head) + len(work) * width].view(len(work), width), tables)
    return DecodeInputs(longs, ints, rows, width, seq_lens)


def page_tables(tables: list[list[int]], width: int, fill: int = 0) -> torch.Tensor:
    """(len(tables), width) int32: each row its page table, then `fill`."""
    if mostly_filled(tables, width):
        return torch.tensor([t + [fill] * (width - len(t)) for t in tables], dtype=torch.int32)
    out = torch.full((len(tables), width), fill, dtype=torch.int32)
    _fill(out, tables)
    return out


def mostly_filled(tables: list[list[int]], width: int) -> bool:
    """Whether a table padded to `width` is at least half real pages. Padding made in Python costs
    per cell: one long stream beside short ones would pad each of them to its length, every step
    (docs/benchmarks.md), so then the pages go in by one masked write instead."""
    return 2 * sum(map(len, tables)) >= len(tables) * width


def _fill(out: torch.Tensor, tables: list[list[int]]) -> None:
    """out (B, width) int32: row i's first len(tables[i]) cells take its pages."""
    lens = torch.tensor([len(t) for t in tables])
    out[torch.arange(out.shape[1]) < lens[:, None]] = torch.tensor([p for t in tables for p in t], dtype=torch.int32)
