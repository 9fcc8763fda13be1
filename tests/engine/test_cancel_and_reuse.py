"""A cancel that reaches the engine after its request ended does not touch a request sent again
under the same id (the model service lets a client reuse an id as soon as it is free)."""

from __future__ import annotations

import threading

from kvserve.model_service.engine.events import Finished, PrefillDone
from kvserve.model_service.engine.request import Request
from kvserve.model_service.sampling.params import SamplingParams
from tests.engine.harness import EngineHarness


def test_a_cancel_queued_as_its_request_finished_leaves_the_next_request_of_that_id_alone(tiny_dirs):
    h = EngineHarness(tiny_dirs["tiny"])
    engine, done, second, cancelled = h.engine, threading.Event(), [], []
    try:
        def first_sink(event) -> None:   # on the engine thread, in the step that ends it
            if isinstance(event, PrefillDone):   # its client leaves as its one token is sampled
                cancelled.append(engine.cancel("same"))
            elif isinstance(event, Finished):   # ended (its id free): the client sends it again
                engine.submit(Request("same", [5, 6, 7], 4, SamplingParams(max_tokens=4, temperature=0.0,
                                                                             ignore_eos=True)), on_second)

        def on_second(event) -> None:
            second.append(event)
            if isinstance(event, Finished):
                done.set()

        engine.submit(Request("same", [5, 6, 7], 1, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)),
                      first_sink)
        assert done.wait(60), "the second request did not end"
        finished = second[-1]
        assert cancelled == [True]   # it was live then: the cancel went into the engine's inbox
        assert finished.reason == "length" and finished.completion_tokens == 4, finished
    finally:
        h.close()


def test_a_late_cancel_of_an_ended_call_leaves_the_request_reusing_its_id_alone(tiny_dirs):
    """The front cancels its call's request when the call ends unfinished (the client gone). If
    the request ended meanwhile and the client sent the id again, that cancel found the new
    request by its id and aborted it after no token: it names its own request now."""
    h = EngineHarness(tiny_dirs["tiny"])
    engine, first_done, second_done, second = h.engine, threading.Event(), threading.Event(), []
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    try:
        first = Request("same", [5, 6, 7], 6, params)
        engine.submit(first, lambda e: first_done.set() if isinstance(e, Finished) else None)
        assert first_done.wait(60)

        def on_second(event) -> None:
            second.append(event)
            if isinstance(event, Finished):
                second_done.set()

        again = Request("same", [5, 6, 7], 6, params)
        engine.submit(again, on_second)
        assert not engine.cancel("same", first)   # the first call's cancel, late
        assert second_done.wait(60)
        assert second[-1].reason == "length" and second[-1].completion_tokens == 6, second[-1]
        assert engine.cancel("same", again) is False   # ended: nothing of that id is live
    finally:
        h.close()


def test_a_request_is_live_only_with_its_sink_set(tiny_dirs):
    """A fail-everything pass (an internal error, the manager lost for good) ends each live
    request through its sink; one made live before its sink was set got no event at all."""
    h = EngineHarness(tiny_dirs["tiny"])
    seen = []

    class Watched(dict):
        def __setitem__(self, key, request) -> None:
            seen.append(request.sink is not None)
            super().__setitem__(key, request)
    try:
        h.engine._live = Watched(h.engine._live)
        done = threading.Event()
        h.engine.submit(Request("r", [5, 6, 7], 1, SamplingParams(max_tokens=1, temperature=0.0)),
                        lambda e: done.set() if isinstance(e, Finished) else None)
        assert done.wait(60) and seen == [True]
    finally:
        h.close()
