"""The engine's standing with its KV-cache manager: registered under an epoch, or lost.

Mechanism only; the engine decides what a loss means for its requests (engine.py). A loss starts
when a Step finds no manager (the stream broke, or the watchdog gave up waiting for an answer)
and ends when a Register under a new epoch succeeds. Past `timeout_s` the loss is declared
*long*: the engine then ends what it holds with UNAVAILABLE and refuses new requests, while this
link goes on trying. A manager that answers with a newer epoch than ours was registered by another
model service: this one is *superseded* and stops trying, so the two never wipe each other in turn.
"""

from __future__ import annotations

import logging
import threading
import time

from kvserve.kvcache_service.contract.client import KVClient
from kvserve.kvcache_service.contract.errors import FailedPrecondition, KVCacheError, ManagerUnavailable

log = logging.getLogger(__name__)

RETRY_WAIT_S = 0.5   # one reconnection attempt waits this long: the engine reads its inbox between
PROBE_TIMEOUT_S = 1.0   # an idle engine's check that the manager still answers
ENDING_WAIT_S = 0.5     # a Step's answer waited for once every request is being ended (hurry())


class ManagerLink:
    def __init__(self, kv: KVClient, page_size: int, num_pages: int, timeout_s: float,
                 clock=time.monotonic, cpu_pages: int | None = None) -> None:
        self.kv = kv
        self.cpu_pages = cpu_pages   # this service's swap pages: the manager checks it has at least its own
        self.page_size = page_size
        self.num_pages = num_pages
        self.timeout_s = timeout_s
        self.wait_limit_s = timeout_s   # the watchdog gives up on a Step's answer after this (hurry())
        self.clock = clock
        self.epoch = 0
        self.lost_since: float | None = None   # when the manager stopped answering
        self.long_loss = False                 # lost for more than timeout_s
        self.superseded_by: int | None = None  # the newer epoch another model service registered
        self._waiting_since: float | None = None   # a Step's answer is awaited since
        self._overdue_since: float | None = None   # the start of the wait the watchdog ended
        self._lock = threading.Lock()          # the engine thread waits, the watchdog interrupts
        self.refusal = ""                      # why the manager refused our last Register, if it did
        self.quiet_since: float | None = None  # an idle engine's probes have gone unanswered since

    # ------------------------------------------------------------ engine thread

    def register(self, timeout_s: float | None = None) -> None:
        """Registers a new epoch (newer than any before: the manager drops what an older one held).
        Raises the manager's KVCacheError; ManagerUnavailable when it did not answer in time."""
        epoch = max(time.time_ns(), self.epoch + 1)
        if not self.epoch:   # a fresh process: newer than its predecessor's, even where the clock stepped back
            live = self._live_epoch(PROBE_TIMEOUT_S)   # (None: no manager answering yet)
            if live is not None:
                epoch = max(epoch, live + 1)
        self.kv.register(epoch, self.page_size, self.num_pages, timeout_s, self.cpu_pages)
        self.epoch = epoch

    def wait_for_plan(self, plan_of):
        """plan_of()'s answer; the watchdog interrupts a wait longer than timeout_s."""
        with self._lock:
            self._waiting_since = self.clock()
        try:
            plan = plan_of()
        except BaseException:
            with self._lock:
                self._waiting_since = None
            raise
        self.quiet_since = None
        with self._lock:   # in one block: a watchdog that gave up on this wait as the answer came
            self._waiting_since = self._overdue_since = None   # leaves no loss behind
        return plan

    def lose(self) -> None:
        """The manager did not answer: the loss dates from the wait the watchdog ended, if it
        ended one, else from now."""
        with self._lock:
            since, self._overdue_since = self._overdue_since, None
        if self.lost_since is None:
            self.lost_since = self.clock() if since is None else since

    def reconnect(self) -> bool:
        """One attempt, waiting up to RETRY_WAIT_S for the manager. True when registered again."""
        try:
            self.register(RETRY_WAIT_S)
        except ManagerUnavailable:
            return False
        except FailedPrecondition:   # a newer epoch is live there: another model service's
            self.superseded_by = self._live_epoch()
            log.error("another model service registered with the KV-cache manager at %s (epoch %s); "
                      "this one stops using it and serves nothing more", self.kv.address, self.superseded_by)
            return False
        except KVCacheError as exc:   # a manager that refuses this engine (another pool size): the loss
            # what clients and readiness read names no address (the log line does)
            refusal = str(exc).replace(f"the KV-cache manager at {self.kv.address}", "its KV-cache manager")
            if refusal != self.refusal:   # goes on, and turns long; said once, not every attempt
                self.refusal = refusal
                log.error("%s; waiting for a manager that takes it", exc)
            return False
        self.lost_since, self.long_loss, self.refusal, self.quiet_since = None, False, "", None
        return True

    def loss_is_long(self) -> bool:
        """Declared once: True the first time the loss has outlasted timeout_s."""
        if self.lost_since is None or self.long_loss or self.clock() - self.lost_since <= self.timeout_s:
            return False
        self.long_loss = True
        return True

    def restarted_elsewhere(self) -> bool:
        """After a Step was refused as stale: did the manager lose our epoch (a restart: register
        again) rather than our engine send a bad Step? Unreachable counts as a restart."""
        live = self._live_epoch()
        if live is not None and live > self.epoch:
            self.superseded_by = live
            log.error("another model service registered with the KV-cache manager at %s (epoch %d); "
                      "this one stops using it and serves nothing more", self.kv.address, live)
        return live != self.epoch

    @property
    def lost(self) -> bool:
        return self.lost_since is not None or self.superseded_by is not None

    # ------------------------------------------------------------ watchdog thread

    def interrupt_if_overdue(self) -> bool:
        """Ends a wait for a Step's answer that has lasted more than timeout_s (the engine thread
        then meets ManagerUnavailable and calls lose())."""
        with self._lock:
            since = self._waiting_since
            if since is None or self.clock() - since <= self.wait_limit_s:
                return False
            self._waiting_since, self._overdue_since = None, since
            # Ended under the lock: an answer that comes meanwhile cannot let the engine send its
            # next Step on this stream first (ended after, it took that Step down: a false loss).
            self.kv.interrupt()
        log.warning("the KV-cache manager at %s has not answered a Step for %.1f s; treating it as lost",
                    self.kv.address, self.clock() - since)
        return True

    def probe(self) -> None:
        """While the engine is idle (it sends no Step, so nothing else would notice): whether the
        manager still answers, for health (quiet_for)."""
        try:
            self.kv.stats(PROBE_TIMEOUT_S)
        except KVCacheError:
            if self.quiet_since is None:
                self.quiet_since = self.clock()
            return
        self.quiet_since = None

    def quiet_for(self) -> float | None:
        """Seconds an idle engine's probes have gone unanswered, or None."""
        since = self.quiet_since
        return None if since is None else self.clock() - since

    def hurry(self) -> None:
        """From now on a Step's answer is waited for ENDING_WAIT_S at most, not timeout_s (a drain
        must end the streams within its grace period, whatever the manager is doing; a healthy
        manager answers well within it, and is not taken for lost)."""
        self.wait_limit_s = min(self.wait_limit_s, ENDING_WAIT_S)

    def _live_epoch(self, timeout_s: float | None = None) -> int | None:
        try:
            return self.kv.stats(timeout_s).epoch
        except KVCacheError:
            return None
