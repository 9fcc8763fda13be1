"""A decode step's host tensors (decode_inputs) and the padded page tables of any step
(page_tables): the same cells whether the padding is made in Python (most cells real) or by one
masked write (one long row beside short ones)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from kvserve.model_service.engine.decode_inputs import decode_inputs, mostly_filled, page_tables
from kvserve.model_service.engine.scheduler import Work

PS = 4


def work_of(lengths: list[int]) -> list[Work]:
    """Rows about to decode their last token, each on its own run of page ids."""
    rows, first = [], 100
    for n in lengths:
        pages = -(-n // PS)
        request = SimpleNamespace(tokens=[(7 * i + n) % 50 for i in range(n)],
                                  page_table=list(range(first, first + pages)) + [999])   # one spare: not read
        rows.append(Work(request, n - 1, 1))
        first += pages
    return rows


def expected_tables(work: list[Work], fill: int, pad: int) -> torch.Tensor:
    lens = [-(-(w.start + 1) // PS) for w in work]
    width = max(lens)
    rows = [w.request.page_table[:n] + [fill] * (width - n) for w, n in zip(work, lens)]
    return torch.tensor(rows + [[fill] * width] * pad, dtype=torch.int32)


@pytest.mark.parametrize("lengths", [[9], [9, 14, 12, 10], [203, 5, 9, 3, 14]], ids=["one", "dense", "sparse"])
@pytest.mark.parametrize("pad", [0, 3])
def test_decode_inputs_hold_each_rows_token_position_slot_and_table(lengths: list[int], pad: int) -> None:
    work = work_of(lengths)
    step = decode_inputs(work, PS, pad=pad, pad_page=77)
    n = len(work)
    assert step.rows == n + pad and step.seq_lens == lengths
    assert step.ids().tolist() == [w.request.tokens[-1] for w in work] + [0] * pad
    assert step.positions().tolist() == [k - 1 for k in lengths] + [0] * pad
    slots = [w.request.page_table[(k - 1) // PS] * PS + (k - 1) % PS for w, k in zip(work, lengths)]
    assert step.slots().tolist() == slots + [77 * PS] * pad
    assert step.sampled().tolist() == list(range(n))
    assert step.cu_seqlens_q().tolist() == list(range(n + pad + 1))
    assert step.lens().tolist() == lengths + [1] * pad
    assert torch.equal(step.tables(), expected_tables(work, 77, pad))


def test_page_tables_pad_short_rows_either_way() -> None:
    dense, sparse = [[1, 2, 3], [4, 5]], [list(range(10, 60)), [1], [2, 3]]
    assert mostly_filled(dense, 3) and not mostly_filled(sparse, 50)
    assert page_tables(dense, 3).tolist() == [[1, 2, 3], [4, 5, 0]]
    assert page_tables(sparse, 50, fill=9).tolist() == [list(range(10, 60)), [1] + [9] * 49, [2, 3] + [9] * 48]
