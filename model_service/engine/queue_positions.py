"""Where a waiting request stands in this worker's queue, told to its stream.

Most requests are taken in by the step after the one that found them in the queue, and hear
nothing of it. One still waiting two steps after the engine took it in (no sequence slot or no
pages for it) is told its place (`Queued`, 1 = next) and told again when it changes (at once
within ALWAYS_TOLD of the head, further back at most once a RETELL_S); once it leaves the queue,
`Queued` with position 0: its prompt is being computed. Only a request that has had no token yet
is told (one preempted back into the queue after its first token is not).

A gateway reads these to tell a request that waited in a worker's queue from one the worker was
computing when it failed: only the second may be what made it fail (services/gateway/relay.py).
"""

from __future__ import annotations

import time
from collections.abc import Collection

from kvserve.model_service.engine.events import Queued
from kvserve.model_service.engine.request import Request, Status
from kvserve.services.plumbing.departure_rate import DepartureRate

WINDOW_S = 60.0   # the rate requests leave the queue is measured over the last minute
STEPS_BEFORE_TELLING = 2
# A request far back is told its new place at most once a RETELL_S (a queue of a thousand would
# otherwise send a thousand messages at each admission); within ALWAYS_TOLD of the head, at once.
RETELL_S = 1.0
ALWAYS_TOLD = 3


class QueuePositions:
    def __init__(self) -> None:
        self._told: set[Request] = set()        # told a place, not yet told they left
        self._left = DepartureRate(WINDOW_S)    # when requests left the queue (first admissions)

    def tell(self, waiting: Collection[Request], step: int, left: int) -> bool:
        """After a step's plan is applied: `waiting` is the queue in order, `step` the engine's
        step count, `left` the requests this step took out of the queue for the first time.
        True when a request was told it left the queue: the engine sends that out before the
        forward that computes it, so that a worker dying in that forward has said so."""
        now = time.monotonic()
        if left:
            self._left.note(now, left)
        if not waiting and not self._told:
            return False
        started = False
        for r in [r for r in self._told if r.status is not Status.WAITING]:
            self._told.discard(r)
            if r.status is not Status.FINISHED:
                r.told_position = 0
                r.sink(Queued(0, 0))
                started = True
        position = 0
        for r in waiting:
            if r.index:   # a child of parallel sampling: its request's place is its parent's
                continue
            position += 1
            if (r.status is Status.FINISHED or r.first_token_at is not None or r.told_position == position
                    or step - r.queued_at_step < STEPS_BEFORE_TELLING):
                continue
            if r.told_position is not None and position > ALWAYS_TOLD and now - r.told_at < RETELL_S:
                continue   # every admission moves everyone behind it: told again in a while, not each time
            r.told_position, r.told_at = position, now
            self._told.add(r)
            r.sink(Queued(position, self._left.eta_ms(position, now)))
        return started
