"""The event log: pages stored in and evicted from the tree, and resets.

Events are numbered from 1, one more per event, and carry the epoch they happened in. The log
keeps an event only while a reader has not read it: with no reader it keeps none (a new reader
starts from a snapshot, or from now), so a manager nobody watches holds no event objects. A
reader that falls more than `capacity` events, or `max_hashes` page hashes, behind loses the
oldest and sees a gap in the numbers: it knows it missed events and starts again from a
snapshot. (An event carries a hash per page it stored or evicted, up to the whole pool: counted
in events alone, a subscriber that stays connected and reads nothing could pin gigabytes.)
"""

from __future__ import annotations

from collections import deque
from itertools import count

from kvserve.kvcache_service.contract.types import CacheReset, Event, PagesEvicted, PagesStored


def _hashes_in(event: Event) -> int:
    return len(event.hashes) if isinstance(event, (PagesStored, PagesEvicted)) else 0


class EventLog:
    __slots__ = ("_events", "_readers", "_at", "_ids", "_kept_hashes", "capacity", "max_hashes", "last", "epoch")

    def __init__(self, capacity: int = 65536, max_hashes: int = 1 << 20) -> None:
        self._events: deque[Event] = deque()
        self._readers: dict[int, int] = {}   # reader -> the number it reads next
        # number -> readers that read it next: what the log may drop is found among these few
        # positions, not by looking at every reader on every read (quadratic in the readers)
        self._at: dict[int, int] = {}
        self._ids = count(1)
        self._kept_hashes = 0
        self.capacity = capacity
        self.max_hashes = max_hashes
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
        self._at[self.last + 1] = self._at.get(self.last + 1, 0) + 1
        return reader

    def close(self, reader: int) -> None:
        start = self._readers.pop(reader, None)
        if start is not None:
            self._leave(start)

    def read(self, reader: int) -> list[Event]:
        """The events `reader` has not read yet that are still kept, oldest first."""
        start = self._readers[reader]
        events = self._events
        if not events or start > self.last:
            return []
        out = [events[i] for i in range(max(0, start - events[0].number), len(events))]
        self._readers[reader] = self.last + 1
        self._at[self.last + 1] = self._at.get(self.last + 1, 0) + 1
        self._leave(start)
        return out

    def __len__(self) -> int:
        return len(self._events)

    def _keep(self, event: Event) -> None:
        events = self._events
        events.append(event)
        self._kept_hashes += _hashes_in(event)
        while len(events) > self.capacity or (self._kept_hashes > self.max_hashes and len(events) > 1):
            self._kept_hashes -= _hashes_in(events.popleft())

    def _leave(self, position: int) -> None:
        """A reader left `position`; when it was the last there, what nobody reads is dropped."""
        left = self._at[position] - 1
        if left:
            self._at[position] = left
            return
        del self._at[position]
        events = self._events
        if not self._at:
            events.clear()
            self._kept_hashes = 0
            return
        oldest = min(self._at)
        while events and events[0].number < oldest:
            self._kept_hashes -= _hashes_in(events.popleft())
