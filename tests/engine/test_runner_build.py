"""ModelRunner.build: a step of decodes only takes a shorter road to the same batch."""

from __future__ import annotations

import random

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve.model_service.engine.request import Request
from kvserve.model_service.engine.runner import ModelRunner
from kvserve.model_service.engine.scheduler import Work


@settings(max_examples=50, deadline=None)
@given(lengths=st.lists(st.integers(1, 70), min_size=1, max_size=9), page_size=st.sampled_from([1, 4, 16]),
       seed=st.integers(0, 2**16))
def test_decodes_build_the_batch_the_general_road_builds(lengths, page_size, seed) -> None:
    rng = random.Random(seed)
    work = []
    for i, n in enumerate(lengths):
        r = Request(f"r{i}", [rng.randrange(3, 100) for _ in range(n)], 8)
        r.page_table = rng.sample(range(1000), -(-n // page_size) + rng.randrange(0, 2))
        work.append(Work(r, n - 1, 1))
    runner = ModelRunner(None, None, None, page_size, torch.device("cpu"))
    fast = runner.build(work)
    slow = runner._build_general(work)
    for name in fast.__dataclass_fields__:
        a, b = getattr(fast, name), getattr(slow, name)
        if isinstance(a, torch.Tensor):
            assert a.dtype == b.dtype and torch.equal(a, b), name
        else:
            assert a == b, name
