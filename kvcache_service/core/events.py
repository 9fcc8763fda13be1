"""The event log: pages stored in and evicted from the tree, and resets.

Events are numbered from 1, one more per event. The log keeps the latest
`capacity` events; a subscriber that falls further behind sees a gap in the
numbers and knows it missed events.
"""

from __future__ import annotations

from collections import deque

from kvserve.kvcache_service.contract.types import CacheReset, Event, PagesEvicted, PagesStored


class EventLog:
    __slots__ = ("_events", "last")

    def __init__(self, capacity: int = 65536) -> None:
        self._events: deque[Event] = deque(maxlen=capacity)
        self.last = 0

    def stored(self, parent_hash: int, hashes: list[int]) -> None:
        if hashes:
            self.last += 1
            self._events.append(PagesStored(self.last, parent_hash, tuple(hashes)))

    def evicted(self, hashes: list[int]) -> None:
        if hashes:
            self.last += 1
            self._events.append(PagesEvicted(self.last, tuple(hashes)))

    def reset(self) -> None:
        self.last += 1
        self._events.append(CacheReset(self.last))

    def since(self, number: int) -> list[Event]:
        """Events numbered >= number that are still kept, oldest first."""
        events = self._events
        if not events or number > self.last:
            return []
        first = events[0].number
        start = max(0, number - first)
        return [events[i] for i in range(start, len(events))]
