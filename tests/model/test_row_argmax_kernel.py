"""The native row argmax (kernels/row_argmax.c) gives torch.argmax's answer: the first of the
largest values, NaN above everything, -0.0 equal to +0.0; at any thread count, including more
threads than columns, and for each thread's range boundaries (libgomp's static split)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve.model_service.kernels import row_argmax
from tests.model.native_kernels import load_or_skip, torch_threads

SPECIAL = [0.0, -0.0, 1.0, -1.0, 2.5, float("inf"), float("-inf"), float("nan"), -float("nan"), 3.4e38, -3.4e38,
           1e-45, -1e-45]


@pytest.fixture(scope="module")
def kernel() -> row_argmax.RowArgmaxKernel:
    return load_or_skip(row_argmax.load, "the native row argmax")


@settings(max_examples=300, deadline=None)
@given(rows=st.integers(1, 5), n=st.integers(1, 140), threads=st.integers(1, 4), seed=st.integers(0, 2**32 - 1),
       mix=st.sampled_from(["special", "ties", "spread"]))
def test_is_torch_argmax(kernel, rows, n, threads, seed, mix) -> None:
    # Values picked from a small pool by a seeded generator: drawing hundreds of floats one by one
    # through hypothesis took most of this test's time. The pools make ties, NaNs and infinities
    # common; "spread" adds values that are all different.
    g = torch.Generator().manual_seed(seed)
    pool = torch.tensor(SPECIAL if mix == "special" else [7.0, 7.0, -7.0, 0.0, -0.0] if mix == "ties"
                        else SPECIAL + (torch.rand(40, generator=g) * 20 - 10).tolist(), dtype=torch.float32)
    x = pool[torch.randint(len(pool), (rows, n), generator=g)]
    with torch_threads(threads):
        got = kernel(x)
    assert got.dtype == torch.int64
    assert got.tolist() == torch.argmax(x, dim=-1).tolist()


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_a_vocabulary_of_logits_and_ties_across_the_threads_ranges(kernel, threads) -> None:
    x = torch.randn(6, 32_000, generator=torch.Generator().manual_seed(3))
    x[1, 20_000] = x[1, 5] = 99.0           # a tie across two threads' ranges: the first
    x[2, 15_999] = x[2, 16_000] = 99.0      # on each side of a two-thread boundary
    x[3, 31_999] = 99.0                     # the very last column
    x[4, :] = float("-inf")                 # nothing but -inf: column 0
    x[5, 30_000] = float("nan")             # a NaN wins over any value
    with torch_threads(threads):
        assert kernel(x).tolist() == torch.argmax(x, dim=-1).tolist()


def test_takes_only_what_it_can_read(kernel) -> None:
    assert kernel.runs(torch.randn(3, 8))
    assert not kernel.runs(torch.randn(8, 3).t())           # not contiguous
    assert not kernel.runs(torch.randn(3, 8).bfloat16())
    assert not kernel.runs(torch.randn(3, 0))
    assert not kernel.runs(torch.randn(8))
    with pytest.raises(ValueError, match="row argmax"):
        kernel(torch.randn(3, 8).double())
