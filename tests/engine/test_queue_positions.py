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


def test_leaving_the_queue_is_sent_out_before_the_forward_that_computes_the_request(tiny_dirs):
    """A gateway counts a worker that dies computing a request's prompt, and not one that dies
    while it waits (services/gateway/relay.py): "left the queue" must be out of the process
    before that forward, not at the end of the step the forward may crash in."""
    h = EngineHarness(tiny_dirs["tiny"], max_num_seqs=1)
    order: list[str] = []
    engine = h.engine
    execute = engine.runner.execute

    def executed(work):
        order.append("forward")
        return execute(work)

    engine.runner.execute = executed
    engine.on_step_end = lambda: order.append("flushed")
    try:
        def tap(outcome, event):
            if isinstance(event, Queued) and event.position == 0:
                order.append("left")
        outcomes = [h.submit([5 + i, 6, 7, 8], max_tokens=6, tap=tap) for i in range(2)]
        wait(outcomes)
        at = order.index("left")
        assert order[at + 1] == "flushed" and "forward" in order[at + 1:], order[at - 2:at + 4]
    finally:
        h.close()


def test_a_place_far_from_the_head_is_told_again_at_most_once_a_second(monkeypatch):
    """Each admission moves everyone behind it: a queue of a thousand sent a thousand messages
    at each one. Near the head each move is told; further back, at most once a RETELL_S."""
    from collections import deque

    from kvserve.model_service.engine import queue_positions
    from kvserve.model_service.engine.request import Request

    clock = [100.0]
    monkeypatch.setattr(queue_positions.time, "monotonic", lambda: clock[0])
    heard: dict[str, list[int]] = {}
    waiting = deque()
    for i in range(8):
        r = Request(f"r{i}", [1, 2], 4)
        r.sink = lambda event, name=r.request_id: heard.setdefault(name, []).append(event.position)
        waiting.append(r)
    positions = queue_positions.QueuePositions()
    for step in range(2, 9):   # one leaves the head each step, a tenth of a second apart
        positions.tell(waiting, step, 0)
        waiting.popleft().status = queue_positions.Status.RUNNING
        clock[0] += 0.1
    assert heard["r7"] == [8, 3, 2], heard["r7"]   # 7..4 unheard (within a second), then each move
    assert heard["r3"] == [4, 3, 2, 1, 0]
