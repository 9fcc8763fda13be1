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
