"""How long a place in a queue is from its turn, from the rate places came free over the last
window: the one estimate of a gateway's queue (services/gateway/waiting.py) and a model
service's (model_service/engine/queue_positions.py)."""

from __future__ import annotations

from collections import deque


class DepartureRate:
    def __init__(self, window_s: float = 60.0) -> None:
        self.window_s = window_s
        self._times: deque[float] = deque()   # when places came free, within the window

    def note(self, now: float, count: int = 1) -> None:
        """`count` places came free at `now`."""
        self._times.extend([now] * count)
        self._trim(now)

    def eta_ms(self, position: int, now: float) -> int:
        """Milliseconds until the place at `position` comes free, at the rate places came free
        over the window up to `now` (a burst long ago, then none, is a slow rate, not the
        burst's); 0 when fewer than two did within it (no estimate)."""
        self._trim(now)
        times = self._times
        if len(times) < 2:
            return 0
        rate = (len(times) - 1) / max(now - times[0], 1e-3)
        return int(1000 * position / rate)

    def __len__(self) -> int:
        return len(self._times)

    def _trim(self, now: float) -> None:
        times = self._times
        while times and times[0] < now - self.window_s:
            times.popleft()
