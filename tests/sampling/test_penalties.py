"""The sparse penalty update (gather/scatter over history ids) against a dense reference."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve.model_service.sampling.penalties import apply_penalties

V = 12


def _dense_reference(logits, prompt, output, rep, pres, freq):
    out = logits.clone()
    for r, (p_ids, o_ids) in enumerate(zip(prompt, output)):
        counts = torch.bincount(torch.tensor(o_ids, dtype=torch.int64), minlength=V).float()
        seen = torch.zeros(V, dtype=torch.bool)
        seen[p_ids + o_ids] = True
        row = out[r]
        row = torch.where(seen, torch.where(row > 0, row / rep[r], row * rep[r]), row)
        out[r] = row - (pres[r] * (counts > 0) + freq[r] * counts)
    return out


histories = st.lists(st.integers(0, V - 1), max_size=6)


@settings(max_examples=200, deadline=None)
@given(
    prompt=st.lists(histories, min_size=1, max_size=4),
    output=st.lists(histories, min_size=4, max_size=4),
    seed=st.integers(0, 2**16),
)
def test_matches_a_dense_reference(prompt, output, seed):
    rows = len(prompt)
    output = output[:rows]
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows + 1, V, generator=gen) * 3  # the last row is never penalised
    rep = torch.rand(rows, generator=gen) + 0.5
    pres = torch.rand(rows, generator=gen) * 4 - 2
    freq = torch.rand(rows, generator=gen) * 4 - 2
    expected = _dense_reference(logits[:rows], prompt, output, rep, pres, freq)

    actual = logits.clone()
    outputs = [torch.tensor(o, dtype=torch.int64) for o in output]  # tensors are accepted too
    apply_penalties(actual, torch.arange(rows), prompt, outputs, rep, pres, freq)
    assert torch.equal(actual[:rows], expected)
    assert torch.equal(actual[rows], logits[rows])


def test_a_row_subset_leaves_other_rows_alone():
    logits = torch.arange(3 * V, dtype=torch.float32).reshape(3, V) - 10
    actual = logits.clone()
    apply_penalties(actual, torch.tensor([1]), [[0, 1]], [[1, 1]], torch.tensor([2.0]),
                    torch.tensor([0.0]), torch.tensor([1.0]))
    assert torch.equal(actual[[0, 2]], logits[[0, 2]])
    assert actual[1, :3].tolist() == [(V - 10) / 2, (V - 9) / 2 - 2.0, V - 8]
