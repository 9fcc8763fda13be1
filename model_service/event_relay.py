"""Engine events onto the asyncio loop: one loop wake-up per engine step, not per event.

The engine thread emits one event per sampled token, so a step of 32 running requests posts 32
events back to back. With one call_soon_threadsafe each, the loop's wake-up pipe is written 32
times, and the loop wakes and takes the GIL from the engine thread in the middle of its step.
Here events only join a list; the engine calls flush() after each pass of its loop, which
schedules one drain handing every event to its call's queue, in the order they were posted.
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
        self._scheduled = False   # a drain is on its way to the loop

    def sink(self, queue: asyncio.Queue) -> Callable[[object], None]:
        """A callable for the engine thread: `queue` gets the event at the next flush."""
        def post(event: object) -> None:
            with self._lock:
                self._pending.append((queue, event))
        return post

    def flush(self) -> None:
        """Engine thread: hands what was posted to the loop (one wake-up, none if nothing)."""
        with self._lock:
            if not self._pending or self._scheduled:
                return
            self._scheduled = True
        try:
            self._loop.call_soon_threadsafe(self._drain)
        except RuntimeError:   # the loop is closed: the server is gone, and its calls with it
            pass

    def _drain(self) -> None:   # on the loop
        with self._lock:
            pending, self._pending, self._scheduled = self._pending, [], False
        for queue, event in pending:
            queue.put_nowait(event)
