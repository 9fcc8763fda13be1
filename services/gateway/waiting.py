"""The gateway's queue: requests that found no worker with room wait here, first in, first out,
and are told where they stand.

Mechanism: positions, renumbered lazily (once after any number of leaves, not once per waiter
per leave); wake-ups, each waiter's own: of the head alone when room may have freed (a worker's
report, a stream's end: only the head may take a worker, so a later request never overtakes an
earlier one, and a report costs one waiter's look, not the whole queue's), of one waiter when it
must notice it was cancelled, and of everyone when positions moved, at most every TELL_EVERY_S
(a thousand cancels in a row cost each waiter a look or two, not a thousand); and the rate at
which room frees, measured from the ends of streams over the last minute, for each waiter's
estimate.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable

from kvserve.services.plumbing.departure_rate import DepartureRate


class QueueFull(Exception):
    pass


class Waiter:
    __slots__ = ("request_id", "since", "position", "woken", "arrived")

    def __init__(self, request_id: str, arrived: float | None = None) -> None:
        self.request_id = request_id
        self.since = time.monotonic()
        self.position = 0               # 1 = next; valid when the queue is not due a renumbering
        self.woken = asyncio.Event()    # something for this waiter to look at
        self.arrived = arrived          # a stream moving back to the front: when it came to the gateway


class WaitQueue:
    WINDOW_S = 60.0
    TELL_EVERY_S = 0.25   # moved positions are told at most this often

    def __init__(self, max_queued: int, on_leave: Callable[[float], None] | None = None) -> None:
        self.max_queued = max_queued
        self.on_leave = on_leave   # given the seconds each waiter waited
        self._waiters: deque[Waiter] = deque()
        self._renumber = False     # positions moved since they were last numbered
        self._telling: asyncio.TimerHandle | None = None   # everyone looks when it fires
        self._ends = DepartureRate(self.WINDOW_S)   # when streams ended: room freed

    def __len__(self) -> int:
        return len(self._waiters)

    def enter(self, request_id: str, front: bool = False, arrived: float = 0.0) -> Waiter:
        """A new waiter at the back; at the front for a stream moving off a failed worker (it was
        admitted before everyone waiting), behind those moving too that came to the gateway
        before it (`arrived`): several streams of one failed worker keep their order."""
        if len(self._waiters) >= self.max_queued and not front:
            raise QueueFull(f"{self.max_queued} requests are already waiting for a worker (--max-queued)")
        waiter = Waiter(request_id, arrived if front else None)
        if front:
            self._waiters.insert(self.fronts_before(arrived), waiter)
            self._moved()   # everyone behind moved down
        else:
            self._waiters.append(waiter)
            waiter.position = len(self._waiters)
        return waiter

    def fronts_before(self, arrived: float) -> int:
        """How many streams moving back wait at the front that came to the gateway before `arrived`."""
        count = 0
        for w in self._waiters:
            if w.arrived is None or w.arrived > arrived:
                break
            count += 1
        return count

    def leave(self, waiter: Waiter) -> None:
        head = bool(self._waiters) and self._waiters[0] is waiter
        try:
            self._waiters.remove(waiter)
        except ValueError:
            return
        if self.on_leave is not None:
            self.on_leave(time.monotonic() - waiter.since)
        if head and self._waiters:
            self._waiters[0].woken.set()   # the new head may take room now
        self._moved()   # everyone behind moved up

    def passed(self) -> None:
        """A request found room without waiting: it counts as a wait of 0 s."""
        if self.on_leave is not None:
            self.on_leave(0.0)

    def position(self, waiter: Waiter) -> int:
        """1 = next."""
        if self._renumber:
            for i, w in enumerate(self._waiters, 1):
                w.position = i
            self._renumber = False
        return waiter.position

    def find(self, request_id: str) -> Waiter | None:
        return next((w for w in self._waiters if w.request_id == request_id), None)

    def wake(self) -> None:
        """Room may have freed: the head looks."""
        if self._waiters:
            self._waiters[0].woken.set()

    def poke(self, waiter: Waiter) -> None:
        """This waiter looks now: it was cancelled."""
        waiter.woken.set()

    def wake_all(self) -> None:
        """Every waiter looks now: the gateway stops."""
        for waiter in self._waiters:
            waiter.woken.set()

    async def changed(self, waiter: Waiter, timeout_s: float) -> None:
        """Until `waiter` has something to look at (or `timeout_s`)."""
        try:
            await asyncio.wait_for(waiter.woken.wait(), timeout_s)
        except TimeoutError:
            pass
        waiter.woken.clear()

    def _moved(self) -> None:
        self._renumber = True
        if self._telling is not None:
            return
        try:
            self._telling = asyncio.get_running_loop().call_later(self.TELL_EVERY_S, self._tell_all)
        except RuntimeError:   # no loop running (a stream closed as the gateway stops): at once
            self._tell_all()

    def _tell_all(self) -> None:
        self._telling = None
        self.wake_all()

    # ------------------------------------------------------------ estimates

    def stream_ended(self) -> None:
        self._ends.note(time.monotonic())
        self.wake()

    def eta_ms(self, position: int) -> int:
        """Milliseconds until the waiter at `position` gets a worker, at the rate streams ended
        over the last minute; 0 when fewer than two did (no estimate)."""
        return self._ends.eta_ms(position, time.monotonic())
