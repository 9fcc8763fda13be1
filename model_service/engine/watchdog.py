"""Is the engine making progress? The engine thread notes where it is (Progress); a watchdog
thread reads that, ends a Step wait the manager has let run past its timeout, logs a stalled
engine with the phase and step it is stuck in, and while the engine is idle (no Step would notice
a dead manager) asks the manager now and then whether it still answers. Health
(engine.problem()) reads the same notes.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from kvserve.model_service.engine.manager_link import ManagerLink

log = logging.getLogger(__name__)


@dataclass
class Progress:
    """Written by the engine thread only; plain attributes, so reading them from another thread
    is safe (at worst one write old)."""
    phase: str = "starting"
    on_manager: bool = False   # the phase is a wait for the KV-cache manager (its own timeout bounds it)
    step: int = 0
    since: float = field(default_factory=time.monotonic)   # the last step that computed, or idle moment
    empty_steps: int = 0   # steps since then that had nothing to compute

    def enter(self, phase: str, on_manager: bool = False) -> None:
        self.phase, self.on_manager = phase, on_manager

    def advanced(self) -> None:
        self.since = time.monotonic()
        self.empty_steps = 0

    def doing(self) -> str:
        """What the engine is doing, as a stall report says it."""
        if self.empty_steps:
            return (f"stepping with nothing to compute ({self.empty_steps} steps: every request in flight waits, "
                    "for pages, a resume or a fork)")
        return self.phase

    def stalled_for(self, busy: bool, limit_s: float) -> float | None:
        """Seconds without progress while there was work, once past `limit_s`; else None."""
        quiet = time.monotonic() - self.since
        return quiet if busy and quiet > limit_s else None


class Watchdog:
    def __init__(self, progress: Progress, link: ManagerLink, busy: Callable[[], bool],
                 stall_timeout_s: float, period_s: float = 0.25, probe_every_s: float = 2.0) -> None:
        self.progress = progress
        self.probe_every_s = probe_every_s   # an idle engine's manager is asked if it still answers
        self._probed_at = 0.0
        self.link = link
        self.busy = busy
        self.stall_timeout_s = stall_timeout_s
        self.period_s = period_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvserve-watchdog", daemon=True)
        self._reported = False

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            self.link.interrupt_if_overdue()
            now = time.monotonic()
            if not self.busy() and not self.link.lost and now - self._probed_at >= self.probe_every_s:
                self._probed_at = now
                self.link.probe()
            stalled = self.progress.stalled_for(self.busy(), self.stall_timeout_s)
            if stalled is not None and not self._reported:
                log.warning("the engine has computed nothing for %.1f s with requests in flight; it is "
                            "%s (step %d)", stalled, self.progress.doing(), self.progress.step)
                self._reported = True
            elif stalled is None and self._reported:
                log.info("the engine is making progress again (step %d)", self.progress.step)
                self._reported = False
