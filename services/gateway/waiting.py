"""The gateway's queue: requests that found no worker with room wait here, first in, first out,
and are told where they stand.

Mechanism: positions; wake-ups, of the head alone when room may have freed (a worker's report,
a stream's end: only the head may take a worker, so a later request never overtakes an earlier
one, and a report costs one waiter's look, not the whole queue's), of everyone when positions
move or a waiter must notice it was cancelled; and the rate at which room frees, measured from
the ends of streams over the last minute, for each waiter's estimate.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable


class QueueFull(Exception):
    pass


class Waiter:
    __slots__ = ("request_id", "since")

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self.since = time.monotonic()


class WaitQueue:
    WINDOW_S = 60.0

    def __init__(self, max_queued: int, on_leave: Callable[[float], None] | None = None) -> None:
        self.max_queued = max_queued
        self.on_leave = on_leave   # given the seconds each waiter waited
        self._waiters: deque[Waiter] = deque()
        self._room = asyncio.Event()    # set when room may have freed (and whenever _moved is)
        self._moved = asyncio.Event()   # set when positions moved, or for everyone to look again
        self._ends: deque[float] = deque()   # when streams ended, within WINDOW_S

    def __len__(self) -> int:
        return len(self._waiters)

    def enter(self, request_id: str, front: bool = False) -> Waiter:
        """A new waiter at the back; at the front for a stream moving off a failed worker (it was
        admitted before everyone waiting)."""
        if len(self._waiters) >= self.max_queued and not front:
            raise QueueFull(f"{self.max_queued} requests are already waiting for a worker (--max-queued)")
        waiter = Waiter(request_id)
        if front:
            self._waiters.appendleft(waiter)
            self.wake_all()   # everyone moved down
        else:
            self._waiters.append(waiter)
        return waiter

    def leave(self, waiter: Waiter) -> None:
        try:
            self._waiters.remove(waiter)
        except ValueError:
            return
        if self.on_leave is not None:
            self.on_leave(time.monotonic() - waiter.since)
        self.wake_all()   # everyone behind moved up

    def passed(self) -> None:
        """A request found room without waiting: it counts as a wait of 0 s."""
        if self.on_leave is not None:
            self.on_leave(0.0)

    def position(self, waiter: Waiter) -> int:
        """1 = next."""
        return self._waiters.index(waiter) + 1

    def find(self, request_id: str) -> Waiter | None:
        return next((w for w in self._waiters if w.request_id == request_id), None)

    def wake(self) -> None:
        """Room may have freed: the head looks."""
        self._room.set()
        self._room = asyncio.Event()

    def wake_all(self) -> None:
        """Every waiter looks again: positions moved, or one was cancelled, or the gateway stops."""
        self.wake()
        self._moved.set()
        self._moved = asyncio.Event()

    async def changed(self, waiter: Waiter, timeout_s: float) -> None:
        """Until `waiter` has something to look at (or `timeout_s`)."""
        event = self._room if self._waiters and self._waiters[0] is waiter else self._moved
        try:
            await asyncio.wait_for(event.wait(), timeout_s)
        except TimeoutError:
            pass

    # ------------------------------------------------------------ estimates

    def stream_ended(self) -> None:
        now = time.monotonic()
        self._ends.append(now)
        while self._ends and self._ends[0] < now - self.WINDOW_S:
            self._ends.popleft()
        self.wake()

    def eta_ms(self, position: int) -> int:
        """Milliseconds until the waiter at `position` gets a worker, at the rate streams ended
        over the last minute; 0 when none has ended yet (no estimate)."""
        ends = self._ends
        if len(ends) < 2:
            return 0
        rate = (len(ends) - 1) / max(ends[-1] - ends[0], 1e-3)
        return int(1000 * position / rate)
