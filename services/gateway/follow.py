"""Keeping up with one worker: its cache events into the index, its load and health into its
state. Two tasks per worker, for as long as it is part of the fleet.

Events: a subscription starts with a snapshot that replaces whatever the index held for the
worker. A new epoch (its manager reset or restarted), a gap in the numbers (it fell behind) or a
lost stream drops the worker's entries at once, and a new subscription rebuilds them from a new
snapshot. A worker whose manager runs in-process publishes no events: it is routed by load only.

Load and health: the worker's WatchServerStats stream, a report whenever its load or health
changes (looked at every --poll-interval) and a heartbeat every second: nothing is asked per
report, and a fleet of quiet workers costs the gateway almost nothing. A worker without it
(an older version) is polled instead: GetServerStats and grpc.health.v1 every --poll-interval.
A worker whose stream or poll fails, or whose stream stays silent for three heartbeats, is
down: its running streams are moved to other workers (relay.py) and it gets nothing new until
it answers again; NOT_SERVING (draining, its manager lost, stalled) gets nothing new. A draining
worker closes its port: a poll it refuses while streams still run there leaves it NOT_SERVING.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

import grpc
from grpc_health.v1 import health_pb2

from kvserve.inference.v1 import inference_pb2 as pb
from kvserve.kvcache.v1 import kvcache_pb2 as kv_pb
from kvserve.kvcache_service.contract.hashing import extra_key_digest
from kvserve.services.gateway.fleet_model import FleetModel, unroutable
from kvserve.services.gateway.index import PrefixIndex
from kvserve.services.gateway.worker import DOWN, NOT_SERVING, SERVING, Load, Worker
from kvserve.services.plumbing import stats_watch

log = logging.getLogger(__name__)

RESUBSCRIBE_MAX_S = 5.0
NO_EVENTS_RETRY_S = 30.0
LOAD_SILENCE_S = 3.0   # three default heartbeats missed: the worker hangs (SIGSTOP, a blocked loop)
LATE_S = 0.5   # a silence timer firing later than this found the gateway's loop busy: no verdict yet
# A worker refusing connections (its drain) while its streams say nothing this long is taken for
# hung: down, its streams moved. Long enough for a long prompt's prefill, which streams nothing.
REFUSED_SILENCE_S = 60.0


async def _cancel(task: asyncio.Task | None) -> None:
    if task is not None:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


def snapshot_hashes(snapshot: kv_pb.Snapshot):
    """A snapshot's page hashes: its packed array, or a message per page from an older manager."""
    return snapshot.hashes if len(snapshot.hashes) else [p.hash for p in snapshot.pages]


class EventCursor:
    """Where one subscription to a worker's events stands (its epoch, the last number): applies
    each event to the index, or says why the subscription must start over."""

    def __init__(self, index: PrefixIndex, worker: str) -> None:
        self.index = index
        self.worker = worker
        self.began = False
        self.epoch = self.last = 0

    def apply(self, event: kv_pb.Event) -> str | None:
        """None when applied; else why the worker's entries were dropped (resubscribe)."""
        index, w = self.index, self.worker
        kind = event.WhichOneof("kind")
        if kind == "snapshot":
            index.replace(w, snapshot_hashes(event.snapshot))
            self.epoch, self.last, self.began = event.epoch, event.number, True
            return None
        if not self.began or event.epoch != self.epoch or event.number != self.last + 1:
            index.drop(w)
            if not self.began:
                return "an event before the snapshot"
            return "a new epoch" if event.epoch != self.epoch else f"a gap after event {self.last}"
        self.last = event.number
        if kind == "stored":
            index.add(w, event.stored.hashes)
        elif kind == "evicted":
            index.remove(w, event.evicted.hashes)
        elif kind == "reset":
            index.drop(w)
        return None


class Follower:
    def __init__(self, worker: Worker, index: PrefixIndex, cache_salt: str, poll_s: float,
                 on_change: Callable[[], None], on_down: Callable[[Worker], None], tenants: bool = False,
                 model: FleetModel | None = None) -> None:
        self.worker = worker
        self.tenants = tenants
        self.model = model   # the fleet's: a worker serving another is not routed to (None: not compared)
        self.foreign: str | None = None   # why nothing is routed here: another model, a report of nonsense
        self.index = index
        self.digest = extra_key_digest(cache_salt)
        self.poll_s = poll_s
        self.on_change = on_change
        self.on_down = on_down
        self.pushed = True   # the worker pushes its load (WatchServerStats); False: it is polled
        self._refused: tuple[int, float] | None = None   # refusing polls: its streams' events then, and since when
        self._events: asyncio.Task | None = None
        self._load: asyncio.Task | None = None
        self._events_stopped = False
        self._broken = 0   # failures in a row following its load (a bug): each waits longer

    def start(self) -> None:
        name = self.worker.address
        self._events = asyncio.create_task(self._follow_events(), name=f"events {name}")
        self._load = asyncio.create_task(self._follow_load(), name=f"load {name}")

    async def stop_events(self) -> None:
        """Its cache routes nothing more: the event stream ends and its pages leave the index. Its
        load is still watched, so that streams still running there move if it fails."""
        if self._events_stopped:   # once: the address may be another worker's by now (re-added)
            return
        self._events_stopped = True
        await _cancel(self._events)
        self.index.drop(self.worker.address)

    async def stop(self) -> None:
        await self.stop_events()
        await _cancel(self._load)

    # ------------------------------------------------------------ events

    async def _follow_events(self) -> None:
        w, wait_s, told_no_events, told_broken = self.worker, 0.2, False, False
        while True:
            try:
                if await self._subscribe():
                    wait_s, told_broken = 0.2, False   # it ran: resubscribe at once, the backoff starts over
                    continue
            except grpc.aio.AioRpcError as exc:
                if exc.code() == grpc.StatusCode.FAILED_PRECONDITION:
                    if not told_no_events:
                        log.warning("worker %s publishes no cache events (%s); routing to it by load only",
                                    w.address, exc.details())
                        told_no_events = True
                    self._forget()
                    await asyncio.sleep(NO_EVENTS_RETRY_S)
                    continue
                log.debug("worker %s: event stream ended: %s", w.address, exc.code().name)
            except Exception:   # a bug here must not leave the worker's entries standing, unfollowed
                (log.exception if not told_broken else log.debug)(   # its traceback once a streak
                    "worker %s: following its cache events failed; its entries are dropped and the stream "
                    "asked for again", w.address, exc_info=True)
                told_broken = True
            self._forget()
            await asyncio.sleep(wait_s)
            wait_s = min(2 * wait_s, RESUBSCRIBE_MAX_S)

    async def _subscribe(self) -> bool:
        """One subscription, until it must start over. True when it had begun (a snapshot came)."""
        w = self.worker
        cursor = EventCursor(self.index, w.address)
        call = w.cache_events.WatchEvents(kv_pb.WatchEventsRequest(snapshot=True))
        try:
            async for event in call:
                why = cursor.apply(event)
                if why is not None:
                    log.info("worker %s: %s; rebuilding its entries from a snapshot", w.address, why)
                    self._forget()
                    return cursor.began
                if event.HasField("snapshot"):
                    w.epoch, w.events_live = cursor.epoch, True
        finally:
            call.cancel()
        return cursor.began

    def _forget(self) -> None:
        self.index.drop(self.worker.address)
        self.worker.events_live = False

    # ------------------------------------------------------------ load and health

    async def _follow_load(self) -> None:
        w = self.worker
        while True:
            asked = time.monotonic()
            try:
                if w.info is None:
                    w.set_info(await w.inference.GetModelInfo(pb.GetModelInfoRequest(), timeout=2))
                    w.changed()
                    w.hashes_match = w.info.extra_key_digest == self.digest
                    if not w.hashes_match:
                        log.error("worker %s hashes its pages with another extra_key (--cache-salt) than this "
                                  "gateway's: its cache cannot be matched, it is routed by load only", w.address)
                    if self._shares_tenants():
                        log.error("worker %s does not take the gateway's tenants (it runs without "
                                  "--trust-tenant-metadata): every tenant would share its cache, so nothing is "
                                  "routed to it", w.address)
                    other = self.model.differs(w.info) if self.model is not None else None
                    self.foreign = unroutable(w.info) or (f"another model: {other}" if other else None)
                    if self.foreign:
                        log.error("nothing is routed to worker %s: %s", w.address, self.foreign)
                if self.pushed:
                    await self._watch_load()   # until the worker ends it: it drained
                else:
                    stats = await w.inference.GetServerStats(pb.GetServerStatsRequest(), timeout=2)
                    if self._refused is not None:   # what answers where connections were refused is
                        self._refused = None        # another process: asked anew what it is and does
                        w.set_info(None)
                        self.pushed = True
                        continue
                    health = await w.health.Check(health_pb2.HealthCheckRequest(), timeout=2)
                    self._take(stats, health.status == health_pb2.HealthCheckResponse.SERVING, asked)
            except grpc.aio.AioRpcError as exc:
                if exc.code() == grpc.StatusCode.UNIMPLEMENTED and self.pushed:
                    log.info("worker %s does not push its load (no WatchServerStats); polling it every %g s",
                             w.address, self.poll_s)
                    self.pushed = False
                    continue
                if exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and self.pushed:   # its streams are full:
                    log.warning("worker %s keeps no more WatchServerStats streams (%s); polling it every %g s",
                                w.address, exc.details(), self.poll_s)                # it is not failing
                    self.pushed = False
                    continue
                if not self.pushed and self._refused_under_streams(exc):
                    self._refusing(exc)
                else:
                    self._down(f"{exc.code().name}: {exc.details()}")
            except asyncio.TimeoutError:
                self._down(f"its load stream sent nothing for {self._load_watch()[1]:g} s")
            except Exception as exc:   # a bug: the worker is down until it answers again, never left unwatched
                self._broken += 1   # (its traceback once a streak, and slower tries: not 20 a second)
                (log.exception if self._broken == 1 else log.debug)("worker %s: following its load failed",
                                                                      w.address, exc_info=True)
                self._down(f"following its load failed: {exc}")
                self.on_change()
                await asyncio.sleep(min(self.poll_s * 2 ** self._broken, RESUBSCRIBE_MAX_S))
                continue
            self.on_change()
            await asyncio.sleep(self.poll_s)

    async def _watch_load(self) -> None:
        """The worker's WatchServerStats: a report whenever its load changes (looked at every
        --poll-interval), a heartbeat every second; silence for three heartbeats is a hung worker
        (asyncio.TimeoutError). One timer per stream watches for it, re-armed only when it
        fires, so a report costs only the note of when it came."""
        request, silence_s = self._load_watch()
        call = self.worker.inference.WatchServerStats(request)
        loop = asyncio.get_running_loop()
        heard, silent = loop.time(), False

        def arm(delay: float) -> asyncio.TimerHandle:
            nonlocal due
            due = loop.time() + delay
            return loop.call_later(delay, watchdog)

        def watchdog() -> None:
            nonlocal timer, silent
            now = loop.time()
            quiet = now - heard
            if quiet < silence_s:
                timer = arm(silence_s - quiet)
            elif now - due > LATE_S:   # this loop was busy, not the worker silent: its report may
                timer = arm(silence_s / 3)   # wait unread behind the backlog; a heartbeat more
            else:
                silent = True
                call.cancel()

        due = 0.0
        timer = arm(silence_s)
        try:
            while True:
                try:
                    stats = await call.read()
                except asyncio.CancelledError:
                    task = asyncio.current_task()
                    if silent and not (task is not None and task.cancelling()):
                        raise asyncio.TimeoutError from None
                    raise
                if stats is grpc.aio.EOF:
                    return
                heard = loop.time()
                # It counts what was routed there an interval before it came: a request routed
                # since may not have reached the worker yet. Held too long, a routing is counted
                # twice until the worker's next report (its next change, or its heartbeat).
                self._take(stats, stats.serving, time.monotonic() - self.poll_s)
                self.on_change()
        finally:
            timer.cancel()
            call.cancel()

    def _load_watch(self) -> tuple[pb.WatchServerStatsRequest, float]:
        """The stream to ask for (a look every --poll-interval, the worker's default heartbeat:
        each second or each look, whichever is rarer) and the silence that means it hangs: three
        heartbeats, by the rule the worker itself applies (stats_watch.periods)."""
        request = pb.WatchServerStatsRequest(interval_ms=min(max(
            stats_watch.MIN_INTERVAL_MS, round(self.poll_s * 1e3)), stats_watch.MAX_PERIOD_MS))
        _, heartbeat_s = stats_watch.periods(request)
        return request, LOAD_SILENCE_S * heartbeat_s / (stats_watch.DEFAULT_HEARTBEAT_MS / 1e3)

    def _shares_tenants(self) -> bool:
        """This gateway's requests carry tenants and the worker would not keep them apart."""
        info = self.worker.info
        return self.tenants and info is not None and not info.trusts_tenant_metadata

    def _refusal(self) -> str:
        """Why the gateway routes nothing to a worker that serves ("": it routes there)."""
        if self.foreign:
            return self.foreign
        if self._shares_tenants():
            return ("it runs without --trust-tenant-metadata: the gateway's tenants would share its cache")
        return ""

    def _take(self, stats: pb.ServerStats, serving: bool, asked: float) -> None:
        w, kv = self.worker, stats.kvcache
        refusal = self._refusal()
        w.excluded = bool(refusal)
        why = (stats.not_serving or "it says it is not serving") if not serving else refusal
        state = NOT_SERVING if why else SERVING
        if state != w.state:
            log.info("worker %s: %s%s", w.address, state, f" ({why})" if why else "")
        w.state, w.not_serving = state, why
        w.loaded(Load(stats.running, stats.waiting, kv.free_pages, kv.cached_pages, kv.used_pages, kv.tree_pages,
                      asked, stats.prefill_tokens))
        self._broken = 0

    def _refused_under_streams(self, exc: grpc.aio.AioRpcError) -> bool:
        """A poll's connection refused (its host answers, nothing listens on the port) while
        streams of this gateway still run there. A draining worker closes its port at once
        (GOAWAY) and serves its streams to their end over the connections they hold; a dead
        process's host resets those too, and each stream fails and moves on its own. Anything
        else (a host unreachable, a poll timed out: a lost machine, a hung process) is down."""
        return (exc.code() == grpc.StatusCode.UNAVAILABLE and "connection refused" in (exc.details() or "").lower()
                and bool(self.worker.relays))

    def _refusing(self, exc: grpc.aio.AioRpcError) -> None:
        """Nothing new goes there; its streams and its lane are left to run to their end, unless
        they say nothing for REFUSED_SILENCE_S (a drain that hung: down)."""
        w, now = self.worker, time.monotonic()
        if self._refused is None or self._refused[0] != w.events_heard:
            self._refused = (w.events_heard, now)
        elif now - self._refused[1] > REFUSED_SILENCE_S:
            self._down(f"it refuses new connections and its streams there said nothing for {REFUSED_SILENCE_S:g} s")
            return
        # grpc's details name the worker's address: the log's, never in what a client may read
        why = "it refuses new connections (draining, or stopped)"
        if w.state != NOT_SERVING or w.not_serving != why:
            log.info("worker %s: %s (%s); its %d streams run on", w.address, why, exc.details(), len(w.relays))
        w.state, w.not_serving = NOT_SERVING, why
        w.changed()

    def _down(self, why: str) -> None:
        w = self.worker
        self.pushed = True   # what answers next may be a newer version
        self._refused = None
        w.not_serving = why   # its latest reason, down already or not
        if w.state != DOWN:
            log.warning("worker %s is down (%s)", w.address, why)
            w.state = DOWN
            w.set_info(None)
            w.load = Load()   # what it said last is not what it holds now
            w.changed()
            self.on_down(w)
