"""One worker as the gateway knows it: its connection, what it reported last, and the gateway's
own counts. Plain state; follow.py updates it, router.py reads it. Whoever changes its state or
info calls changed(), as its own load methods do, so that its place on the fleet's board
(board.py, which sets on_change) follows."""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property

import grpc
from grpc_health.v1 import health_pb2_grpc

from kvserve.inference.v1 import inference_pb2 as pb
from kvserve.inference.v1 import inference_pb2_grpc as pb_grpc
from kvserve.kvcache.v1 import kvcache_pb2_grpc as kv_pb_grpc
from kvserve.services.gateway.lane import LaneChannel
from kvserve.services.plumbing.lane_wire import dial_target
from kvserve.services.plumbing.tls import ClientTLS, aio_channel

log = logging.getLogger(__name__)

STARTING, SERVING, NOT_SERVING, DOWN = "starting", "serving", "not serving", "down"
CANCEL_TIMEOUT_S = 1.0   # a worker that does not answer a Cancel in this long is not waited for


@dataclass
class Load:
    """What the worker reported last (its WatchServerStats stream, or a GetServerStats poll)."""
    running: int = 0
    waiting: int = 0
    free_pages: int = 0
    cached_pages: int = 0
    used_pages: int = 0
    tree_pages: int = 0
    asked_at: float = 0.0     # it counts the requests routed there before this moment
    prefill_tokens: int = 0   # prompt tokens its running sequences have yet to compute


class Routing:
    """A request this gateway sent to a worker. It counts as the worker's until a load report made
    after the worker took the call: during a burst a worker may take a call long after it was
    sent, and a report that does not count it yet must not make room for another."""

    __slots__ = ("taken_at", "sequences", "prefill")

    def __init__(self, sequences: int = 1, prefill: int = 0) -> None:
        self.taken_at = math.inf   # until its response headers come
        self.sequences = sequences   # its n: each runs in the worker's batch
        self.prefill = prefill     # prompt tokens it computes there, as routed; 0 once its prefill is done

    def take(self) -> None:
        """The worker has the call (its response headers came): reports from an interval on count it."""
        self.taken_at = time.monotonic()


@dataclass(eq=False)
class Worker:
    address: str
    channel: grpc.aio.Channel
    state: str = STARTING
    info: pb.ModelInfo | None = None
    load: Load = field(default_factory=Load)
    routed_at: list[Routing] = field(default_factory=list)   # routings its last load does not show yet
    ended_since_report: int = 0   # streams of this gateway that ended there after its last report was asked
    last_routed: float = 0.0
    epoch: int = 0
    events_live: bool = False
    hashes_match: bool = True   # its extra_key is ours: the index may route to its cache
    not_serving: str = ""     # why its state is not serving or down, in its words or the gateway's
    excluded: bool = False    # the gateway routes nothing to it, whatever it says (another model, mixed tenants)
    closed: bool = False      # removed and its channel closed: a request routed there just before goes elsewhere
    requests_routed: int = 0
    hit_tokens: int = 0       # prompt tokens its cache held, as its PrefillDone events said
    prompt_tokens: int = 0
    migrated_away: int = 0
    relays: set = field(default_factory=set)                # the streams now running on it
    events_heard: int = 0     # their events from it, ever: whether they still make progress
    streaming: int = 0        # their sequences (a request of n runs n), running or waiting there
    prefilling: int = 0       # prompt tokens those streams compute there before their first token
    prefills_done: list = field(default_factory=list)   # (when, tokens) of those done since its last report was asked
    held_since: float = -math.inf   # a call there failed or was refused as full: no routing until a later report
    on_change: Callable[[Worker], None] | None = field(default=None, repr=False)   # the fleet board's update
    tls: ClientTLS | None = field(default=None, repr=False)
    lanes: bool = True        # Generate over the worker's lane when it offers one (the gateway's --lane)
    lane: LaneChannel | None = field(default=None, repr=False)

    @classmethod
    def connect(cls, address: str, tls: ClientTLS | None = None, lanes: bool = True) -> Worker:
        return cls(address, aio_channel(address, tls, [
            ("grpc.max_receive_message_length", 64 << 20), ("grpc.max_send_message_length", 64 << 20),
            ("grpc.initial_reconnect_backoff_ms", 200), ("grpc.max_reconnect_backoff_ms", 2000)]), tls=tls, lanes=lanes)

    def set_info(self, info: pb.ModelInfo | None) -> None:
        """What the worker said of itself (None: forgotten, it went down); its lane follows."""
        self.info = info
        self.close_lane()
        target = dial_target(self.address, info.lane_address) if info is not None and info.lane_address else None
        if target is not None and self.lanes:
            try:
                self.lane = LaneChannel(target, self.tls, self.inference.Generate, pings=info.lane_pings)
            except (OSError, ValueError) as exc:   # its TLS files unreadable now (being rotated): gRPC serves
                log.warning("worker %s: its lane at %s cannot be set up (%s); its requests go over gRPC until "
                            "it is asked what it is again", self.address, info.lane_address, exc)
        elif target is None and self.lanes and info is not None and info.lane_address:
            log.warning("worker %s offers its lane at %s, which this gateway cannot dial (a Unix socket is dialled "
                        "only for a worker reached over one); its requests go over gRPC", self.address,
                        info.lane_address)

    def close_lane(self) -> None:
        if self.lane is not None:
            self.lane.close()
            self.lane = None

    def generate(self, request: pb.GenerateRequest, timeout: float | None, metadata: tuple = ()):
        """A Generate call there, over its lane when it has one, else gRPC: the same call either way."""
        if self.lane is not None:
            return self.lane.generate(request, timeout, metadata)
        return self.inference.Generate(request, timeout=timeout, metadata=metadata)

    # One stub each, made on first use: a stub per call cost every routed request its making.
    @cached_property
    def inference(self) -> pb_grpc.InferenceStub:
        return pb_grpc.InferenceStub(self.channel)

    @cached_property
    def cache_events(self) -> kv_pb_grpc.KVCacheEventsStub:
        return kv_pb_grpc.KVCacheEventsStub(self.channel)

    @cached_property
    def health(self) -> health_pb2_grpc.HealthStub:
        return health_pb2_grpc.HealthStub(self.channel)

    @property
    def pending(self) -> int:
        """Requests routed here that its last load report does not count yet."""
        return len(self.routed_at)

    @property
    def active(self) -> int:
        """Its load as far as the gateway can tell: the sequences running there and the requests
        waiting, as its last report counts them, less this gateway's streams that ended since,
        plus the sequences of the requests sent since (a request of n runs n in the batch)."""
        sent = sum(r.sequences for r in self.routed_at)
        reported = max(0, self.load.running + self.load.waiting - self.ended_since_report) + sent
        # At least this gateway's own streams there: a report counts a request of n partly running
        # by its running sequences only, and one waiting as one.
        return max(reported, self.streaming)

    def _untaken(self) -> list[Routing]:
        """The requests sent here that it has not taken yet (no response headers)."""
        return [r for r in self.routed_at if r.taken_at == math.inf]

    @property
    def untaken(self) -> int:
        """The sequences of the requests sent here that it has not taken yet (their prompts are in
        prefill_backlog)."""
        return sum(r.sequences for r in self._untaken())

    @property
    def prefill_backlog(self) -> int:
        """Prompt tokens it computes before a request sent now, as far as the gateway can tell: its
        last report's, less this gateway's streams' prefills done since, plus the requests sent
        and not yet taken; at least this gateway's own streams' yet to be done (a report counts
        a prompt only once a step runs it, so a request taken but not yet in a step is in neither).
        A prefill of one step is a long step: a worker busy with one is further from a new
        request's first token than its sequence count says."""
        sent = sum(r.prefill for r in self._untaken())
        done = sum(tokens for _, tokens in self.prefills_done)
        reported = max(0, self.load.prefill_tokens - done) + sent
        return max(reported, self.prefilling)

    @property
    def held_off(self) -> bool:
        """A call there failed or was refused since its last report was asked: until a report
        asked after that, what it said is not what it is (full, or gone), and a request sent
        there would fail again (spending a move, or the next moved request's)."""
        return self.load.asked_at < self.held_since

    def hold_off(self) -> None:
        self.held_since = time.monotonic()
        self.changed()

    async def cancel(self, request_id: str, metadata: tuple = ()) -> None:
        """Cancel there (its tenant in `metadata`, which the worker checks); its status as raised."""
        await self.inference.Cancel(pb.CancelRequest(request_id=request_id), timeout=CANCEL_TIMEOUT_S,
                                    metadata=metadata)

    def changed(self) -> None:
        """Its state, info or load changed: its place on the board moves."""
        if self.on_change is not None:
            self.on_change(self)

    def loaded(self, load: Load) -> None:
        self.load = load
        self.routed_at = [r for r in self.routed_at if r.taken_at >= load.asked_at]
        self.ended_since_report = 0
        # a prefill done before the report was asked is not in it; one done after may be
        self.prefills_done = [d for d in self.prefills_done if d[0] >= load.asked_at]
        self.changed()

    def routed(self, sequences: int = 1, prefill: int = 0) -> Routing:
        """Counts a request of `sequences` (its n) sent here, `prefill` of its prompt tokens to
        compute; returns its mark (Routing.take(), prefilled(), ended()). Its prompt tokens count
        in the stats once the worker has taken it (relay.py, at its prefill_done)."""
        now = time.monotonic()
        mark = Routing(sequences, prefill)
        self.prefilling += prefill
        self.routed_at.append(mark)
        self.last_routed = now
        self.requests_routed += 1
        self.changed()
        return mark

    def stream_started(self, relay, sequences: int) -> None:
        """A stream of `sequences` (its n) now runs here (taken or waiting)."""
        self.relays.add(relay)
        self.streaming += sequences
        self.changed()

    def sequence_ended(self) -> None:
        """One sequence of a stream here finished; the stream goes on with its others."""
        self.streaming -= 1
        self.changed()

    def stream_ended(self, relay, sequences: int, mark: Routing) -> None:
        """The stream left, `sequences` of it still unfinished here."""
        self.relays.discard(relay)
        self.streaming -= sequences
        self.ended(mark)

    def prefilled(self, mark: Routing) -> None:
        """A stream routed here has its prompt computed (its prefill_done came), or left before."""
        if not mark.prefill:
            return
        self.prefilling -= mark.prefill
        if mark.taken_at != math.inf:   # the worker had it: its last report may count it running
            self.prefills_done.append((time.monotonic(), mark.prefill))
        mark.prefill = 0   # (its place on the board, by sequence count, stays)

    def ended(self, mark: Routing) -> None:
        """A stream routed here ended: no longer pending if no report counted it yet, else its
        sequences fewer than the report says."""
        self.prefilled(mark)
        try:
            self.routed_at.remove(mark)
        except ValueError:   # its report counted it: as running sequences, or one waiting request
            self.ended_since_report += mark.sequences   # (too many, at worst: `streaming` floors it)
        self.changed()

    def stats(self, index_pages: int) -> pb.WorkerStats:
        ld = self.load
        return pb.WorkerStats(
            address=self.address, state=self.state, running=ld.running, waiting=ld.waiting,
            used_pages=ld.used_pages, free_pages=ld.free_pages, cached_pages=ld.cached_pages,
            requests_routed=self.requests_routed, hit_tokens=self.hit_tokens, prompt_tokens=self.prompt_tokens,
            epoch=self.epoch, events_live=self.events_live, index_pages=index_pages,
            migrated_away=self.migrated_away, not_serving=self.not_serving,
            lane=self.lane.where if self.lane is not None and not self.lane.failing else "",
            prefill_tokens=self.prefill_backlog)
