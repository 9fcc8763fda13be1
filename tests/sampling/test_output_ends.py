"""OutputProcessor (engine/output.py) at a request's end: text the detokenizer still holds (a
token's whole characters before a character it leaves incomplete) goes out whatever ends the
request, and through the stop-string check."""

from __future__ import annotations

import pytest

from kvserve.model_service.engine.output import OutputProcessor
from kvserve.model_service.engine.request import Request
from kvserve.model_service.sampling.params import SamplingParams

FFFD = "\ufffd"


@pytest.fixture(scope="module")
def split_token(tokenizer) -> tuple[int, str]:
    """A token that decodes to whole characters and then part of one (a space and a CJK
    character's first bytes): the detokenizer holds all of its text until the character ends."""
    for token in range(len(tokenizer)):
        text = tokenizer.decode([token])
        if len(text) > 1 and text.endswith(FFFD) and FFFD not in text[:-1]:
            return token, text[:-1]
    raise AssertionError("the test corpus's tokenizer has no such token")


def processor(tokenizer, max_tokens: int, **params) -> OutputProcessor:
    request = Request("r", tokenizer.encode("Hello", add_special_tokens=False), max_tokens,
                      SamplingParams(**params))
    return OutputProcessor(request, tokenizer, frozenset({tokenizer.eos_token_id}))


def test_the_last_tokens_held_text_is_searched_for_stop_strings(tokenizer, split_token):
    """It was released after the stop check: a stop string reached the client, ending "length"."""
    token, whole = split_token
    out = processor(tokenizer, 1, stop=(whole,))
    assert out.add(token) == ("", True, "stop", whole)
    out = processor(tokenizer, 1)
    assert out.add(token) == (whole + FFFD, True, "length", None)   # as the whole output decodes


@pytest.mark.parametrize("ender", ["eos", "stop_token_id"])
def test_an_eos_or_stop_token_releases_the_text_held_before_it(tokenizer, split_token, ender):
    """It was dropped with the ending token's own text: whole characters lost."""
    token, whole = split_token
    end = tokenizer.eos_token_id if ender == "eos" else tokenizer.pad_token_id
    out = processor(tokenizer, 8, stop_token_ids=(tokenizer.pad_token_id,))
    assert out.add(token) == ("", False, None, None)   # held: its character is not done
    assert out.add(end) == (whole + FFFD, True, "stop", end)
    out = processor(tokenizer, 8, stop=(whole,))
    assert out.add(token) == ("", False, None, None)
    assert out.add(tokenizer.eos_token_id) == ("", True, "stop", whole)


def test_a_completed_format_releases_the_held_text_through_the_stop_check(tokenizer, split_token):
    token, whole = split_token
    assert processor(tokenizer, 8).add(token, format_done=True) == (whole + FFFD, True, "stop", None)
    assert processor(tokenizer, 8, stop=(whole,)).add(token, format_done=True) == ("", True, "stop", whole)
