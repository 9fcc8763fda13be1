"""Engine events onto the asyncio loop: one loop wake-up per burst of events, not per event.

The engine thread emits one event per sampled token, so a step of 32 running requests posts 32
events back to back. With one call_soon_threadsafe each, the loop's wake-up pipe is written 32
times and the loop wakes (and takes the GIL from the engine thread) up to 32 times per step.
Here the first event of a burst schedules one drain and the rest join its list; the drain hands
every event to its call's queue in the order they were posted.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable


class EventRelay:
    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._lock = threading.Lock()
        self._pending: list[tuple[asyncio.Queue, object]] = []

    def sink(self, queue: asyncio.Queue) -> Callable[[object], None]:
        """A callable for the engine thread that delivers each event to `queue`."""
        def post(event: object) -> None:
            with self._lock:
                first = not self._pending   # else a drain is already scheduled and will take it
                self._pending.append((queue, event))
            if first:
                self._loop.call_soon_threadsafe(self._drain)
        return post

    def _drain(self) -> None:   # on the loop
        with self._lock:
            pending, self._pending = self._pending, []
        for queue, event in pending:
            queue.put_nowait(event)
