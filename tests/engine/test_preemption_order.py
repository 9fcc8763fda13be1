"""Preemption keeps arrival order: a request preempted to let an older one grow comes back before
any request younger than it, and so finishes before them (FCFS). A step that preempted admitted a
younger waiting request into the room it had just freed: that one then ran ahead of the victim,
and, as the newer tail, made the victim the next victim again."""

from __future__ import annotations

import pytest

from tests.engine.harness import EngineHarness, Outcome, wait


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_requests_preempted_for_an_older_one_finish_in_arrival_order(tiny_dirs, mode, monkeypatch):
    ended: list[str] = []
    sink = Outcome.sink

    def recording(self, event):
        sink(self, event)
        if self.done.is_set() and self.request_id not in ended:
            ended.append(self.request_id)

    monkeypatch.setattr(Outcome, "sink", recording)
    extra = {"preemption_mode": mode, "swap_pages": 40} if mode == "swap" else {}
    h = EngineHarness(tiny_dirs["tiny"], page_size=4, num_pages=10, max_num_seqs=8, **extra)
    try:
        # each needs 9 of the 10 pages by its end: they run nearly one at a time
        outcomes = [h.submit([10 * i + t for t in range(1, 5)], 30) for i in range(4)]
        wait(outcomes)
        assert ended == [o.request_id for o in outcomes]
        assert all(len(o.tokens) == 30 for o in outcomes)
        assert h.stats().used_pages == 0
    finally:
        h.close()
