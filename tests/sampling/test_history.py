"""sampling/history.py: a request's tokens as a tensor that takes in only what was appended."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve.model_service.engine.request import Request
from kvserve.model_service.sampling.history import TokenHistory


@settings(max_examples=200, deadline=None)
@given(prompt=st.lists(st.integers(0, 1000), min_size=1, max_size=20),
       appends=st.lists(st.lists(st.integers(0, 1000), max_size=9), max_size=12))
def test_the_views_are_the_lists_slices_after_any_appends(prompt, appends):
    tokens = list(prompt)
    history = TokenHistory(len(prompt))
    history.sync(tokens)
    for more in appends:
        tokens.extend(more)
        history.sync(tokens)
        assert history.prompt.tolist() == prompt
        assert history.output.tolist() == tokens[len(prompt):]
        assert history.output_then([7, 8]).tolist() == tokens[len(prompt):] + [7, 8]


def test_only_the_new_tokens_are_converted():
    """Converting the whole list each step made a request's steps cost the square of its length."""
    tokens = list(range(10))
    history = TokenHistory(4)
    history.sync(tokens)
    tokens[:10] = [-1] * 10   # (a request never rewrites its tokens: this shows what is read again)
    tokens.append(99)
    history.sync(tokens)
    assert history.output.tolist() == [4, 5, 6, 7, 8, 9, 99]


def test_a_history_that_would_shrink_is_refused():
    history = TokenHistory(1)
    history.sync([1, 2, 3])
    with pytest.raises(ValueError, match="only grows"):
        history.sync([1, 2])


def test_a_requests_penalty_history_follows_its_tokens():
    r = Request("r", [5, 6, 7], max_tokens=10)
    prompt, output = r.penalty_history()
    assert prompt.tolist() == [5, 6, 7] and output.tolist() == []
    r.tokens.extend([8, 9])
    prompt, output = r.penalty_history()
    assert output.dtype == torch.int64 and output.tolist() == [8, 9]
