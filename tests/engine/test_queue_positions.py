"""A request that waits in the worker's queue is told its place, and told when it leaves
(engine/queue_positions.py); one the engine takes at once hears nothing of a queue."""

from __future__ import annotations

from kvserve.model_service.engine.events import PrefillDone, Queued
from tests.engine.harness import EngineHarness, wait


def _recording(log: list):
    return lambda outcome, event: log.append(event) if isinstance(event, (Queued, PrefillDone)) else None


def test_waiting_requests_hear_their_place_then_that_they_left(tiny_dirs):
    h = EngineHarness(tiny_dirs["tiny"], max_num_seqs=1)
    try:
        logs = [[], [], []]
        outcomes = [h.submit([5 + i, 6, 7, 8], max_tokens=12, tap=_recording(log)) for i, log in enumerate(logs)]
        wait(outcomes)
        first, second, third = logs
        assert [type(e) for e in first] == [PrefillDone], first   # taken at once: no queue
        for log in (second, third):
            queued = [e.position for e in log if isinstance(e, Queued)]
            assert isinstance(log[-1], PrefillDone) and isinstance(log[-2], Queued), log
            assert queued[-1] == 0 and queued.count(0) == 1, queued   # left the queue once, before its prefill
            assert queued[:-1] == sorted(queued[:-1], reverse=True) and queued[-2] == 1, queued
        assert [e.position for e in third if isinstance(e, Queued)][0] == 2   # behind the second
        # the third's place 1 came after two requests had left the queue: an estimate
        assert [e.eta_ms for e in third if isinstance(e, Queued) and e.position == 1][0] > 0
    finally:
        h.close()


def test_requests_taken_in_at_once_hear_nothing_of_a_queue(tiny_dirs):
    h = EngineHarness(tiny_dirs["tiny"], max_num_seqs=8)
    try:
        logs = [[] for _ in range(6)]
        outcomes = [h.submit([5 + i, 6, 7], max_tokens=8, tap=_recording(log)) for i, log in enumerate(logs)]
        wait(outcomes)
        assert all([type(e) for e in log] == [PrefillDone] for log in logs), logs
    finally:
        h.close()
