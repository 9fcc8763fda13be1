"""The event log: pages stored in and evicted from the tree, and resets.

Events are numbered from 1, one more per event, and carry the epoch they happened in. The log
keeps an event only while a reader has not read it: with no reader it keeps none (a new reader
starts from a snapshot, or from now), so a manager nobody watches holds no event objects. A
reader that falls more than `capacity` events behind loses the oldest and sees a gap in the
numbers: it knows it missed events and starts again from a snapshot.
"""

from __future__ import annotations

from collections import deque
from itertools import count

from kvserve.kvcache_service.contract.types import CacheReset, Event, PagesEvicted, PagesStored


class EventLog:
    __slots__ = ("_events", "_readers", "_ids", "capacity", "last", "epoch")

    def __init__(self, capacity: int = 65536) -> None:
        self._events: deque[Event] = deque()
        self._readers: dict[int, int] = {}   # reader -> the number it reads next
        self._ids = count(1)
        self.capacity = capacity
        self.last = 0
        self.epoch = 0

    def stored(self, parent_hash: int, hashes: list[int]) -> None:
        if hashes:
            self.last += 1
            if self._readers:
                self._keep(PagesStored(self.last, parent_hash, tuple(hashes), self.epoch))

    def evicted(self, hashes: list[int]) -> None:
        if hashes:
            self.last += 1
            if self._readers:
                self._keep(PagesEvicted(self.last, tuple(hashes), self.epoch))

    def reset(self) -> None:
        self.last += 1
        if self._readers:
            self._keep(CacheReset(self.last, self.epoch))

    # ------------------------------------------------------------ readers

    def open(self) -> int:
        """A new reader; it reads what happens from now on (after the last event)."""
        reader = next(self._ids)
        self._readers[reader] = self.last + 1
        return reader

    def close(self, reader: int) -> None:
        self._readers.pop(reader, None)
        self._trim()

    def read(self, reader: int) -> list[Event]:
        """The events `reader` has not read yet that are still kept, oldest first."""
        start = self._readers[reader]
        events = self._events
        if not events or start > self.last:
            return []
        out = [events[i] for i in range(max(0, start - events[0].number), len(events))]
        self._readers[reader] = self.last + 1
        self._trim()
        return out

    def __len__(self) -> int:
        return len(self._events)

    def _keep(self, event: Event) -> None:
        self._events.append(event)
        if len(self._events) > self.capacity:
            self._events.popleft()

    def _trim(self) -> None:
        """Drops what every reader has read."""
        events = self._events
        if not self._readers:
            events.clear()
            return
        oldest = min(self._readers.values())
        while events and events[0].number < oldest:
            events.popleft()
