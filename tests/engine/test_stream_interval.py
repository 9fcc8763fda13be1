"""The engine's side of --stream-interval: which Tokens events a request's listener gets.

Over gRPC the servicer may merge events that pile up behind a slow client; here, at the
engine, the cut is exact: the first token alone, then one event per INTERVAL tokens (counted
from the last event: --stream-interval is tokens per chunk), the rest on finish, always before
Finished.
"""

from __future__ import annotations

import threading

import pytest

from kvserve.model_service.engine.events import Finished, Tokens
from kvserve.model_service.engine.request import Request
from kvserve.model_service.sampling.params import SamplingParams
from tests.engine.harness import EngineHarness
from tests.service.util import wait_until

INTERVAL = 4
PROMPT = [5, 17, 300, 42, 9, 77, 130]


@pytest.fixture(scope="module")
def harness(tiny_dirs):
    h = EngineHarness(tiny_dirs["tiny"], page_size=4, stream_interval=INTERVAL)
    yield h
    h.close()


def events_of(harness: EngineHarness, request_id: str, max_tokens: int, **params):
    """The request's events as they come, and Events set at its first Tokens and at Finished."""
    events: list = []
    first, done = threading.Event(), threading.Event()

    def sink(event) -> None:
        events.append(event)
        if isinstance(event, Tokens):
            first.set()
        if isinstance(event, Finished):
            done.set()

    sp = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=max_tokens, **params)
    harness.engine.submit(Request(request_id, list(PROMPT), max_tokens, sp), sink)
    return events, first, done


@pytest.mark.parametrize("max_tokens, sizes", [(1, [1]), (4, [1, 3]), (5, [1, 4]), (6, [1, 4, 1]),
                                                     (11, [1, 4, 4, 2])])
def test_first_token_alone_then_every_interval(harness, max_tokens, sizes):
    events, _, done = events_of(harness, f"sizes-{max_tokens}", max_tokens, logprobs=1)
    assert done.wait(60)
    tokens = [e for e in events if isinstance(e, Tokens)]
    assert [len(e.token_ids) for e in tokens] == sizes
    assert all(len(e.logprobs) == len(e.token_ids) for e in tokens)
    assert isinstance(events[-1], Finished) and events[-1].completion_tokens == max_tokens


def test_a_cancel_sends_the_unsent_tokens_before_finished(tiny_dirs):
    # An interval longer than the request: after the first token, everything waits for the end.
    h = EngineHarness(tiny_dirs["tiny"], page_size=4, stream_interval=10_000)
    try:
        events, first, done = events_of(h, "cancel-me", 500)
        assert first.wait(60)
        # a few more tokens sampled, none sent (the harness runs this request alone)
        wait_until(lambda: h.engine.counters.generated_tokens >= 3, timeout=60, what="three tokens sampled")
        assert h.engine.cancel("cancel-me")
        assert done.wait(60)
    finally:
        h.close()
    finished = events[-1]
    assert finished.reason == "abort" and 1 < finished.completion_tokens < 500
    sizes = [len(e.token_ids) for e in events if isinstance(e, Tokens)]
    assert sizes == [1, finished.completion_tokens - 1]
