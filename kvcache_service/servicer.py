"""The gRPC face of the manager: decode, call the core, encode. No logic of its own.

All handlers run on the server's one asyncio loop, so the core is only ever
touched by one call at a time and needs no lock. Domain errors become gRPC
status codes here, by the one table both sides read (contract/status.py).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import TypeVar

import grpc
from prometheus_client import Gauge, Histogram

from kvserve.kvcache.v1 import kvcache_pb2 as pb
from kvserve.kvcache.v1 import kvcache_pb2_grpc as pb_grpc
from kvserve.kvcache_service.contract import convert
from kvserve.kvcache_service.contract.errors import InvalidArgument, KVCacheError
from kvserve.kvcache_service.contract.status import STATUS_OF
from kvserve.kvcache_service.contract.types import Fork, Resume
from kvserve.kvcache_service.core.manager import KVCacheManager

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["KVCacheManager"].full_name

T = TypeVar("T")
log = logging.getLogger(__name__)


class KVCacheServicer(pb_grpc.KVCacheManagerServicer):
    def __init__(self, manager: KVCacheManager, step_seconds: Histogram, step_streams: Gauge | None = None) -> None:
        self.m = manager
        self.step_seconds = step_seconds
        self.step_streams = step_streams   # open StepStream calls, for the metrics
        self._events = manager.events
        self._wake = asyncio.Event()  # replaced after each set: a broadcast to event watchers
        self._last_event = self._events.last
        self._closing = False

    def close(self) -> None:
        """Shutting down: end the event streams so the drain does not wait on them."""
        self._closing = True
        self._wake.set()

    async def _run(self, context: grpc.aio.ServicerContext, fn: Callable[[], T]) -> T:
        """Runs one core call; a domain error ends the RPC with its status code."""
        try:
            out = fn()
        except KVCacheError as exc:
            await context.abort(STATUS_OF[type(exc)], str(exc))
        except Exception:   # a bug in the core: its traceback in the log, an id for it in the status
            incident = uuid.uuid4().hex[:12]
            log.exception("internal error in the manager (incident %s)", incident)
            await context.abort(grpc.StatusCode.INTERNAL, f"internal error in the manager (incident {incident}; "
                                "its log has the details)")
        if self._events.last != self._last_event:
            self._last_event = self._events.last
            self._wake.set()
            self._wake = asyncio.Event()
        return out

    def _seq_id(self, ref: pb.SequenceRef, what: str = "seq") -> int:
        kind = ref.WhichOneof("id")
        if kind == "seq_id":
            return ref.seq_id
        if kind == "request_id":
            return self.m.seq_id_of(ref.request_id)
        raise InvalidArgument(f"{what}: set seq_id or request_id")

    @staticmethod
    def _commit(request: pb.CommitRequest):
        if not request.HasField("commit"):   # unset, it reads as a commit of sequence 0
            raise InvalidArgument("commit: set it (seq_id, num_computed and token_ids)")
        return convert.commit_from_pb(request.commit)

    # --------------------------------------------------------------- RPCs

    async def Register(self, request, context):
        m = self.m
        cpu_pages = request.cpu_pages if request.HasField("cpu_pages") else None
        before = m.state.epoch, len(m.state.seqs)
        reset = await self._run(context, lambda: m.register(request.epoch, request.page_size, request.num_pages,
                                                            cpu_pages))
        if reset:   # who holds the pool now, and what the one before lost with it
            who = f"{request.instance[:128]!r} at {context.peer()}" if request.instance else context.peer()
            if before[0]:
                log.warning("model service %s registered epoch %d in place of epoch %d: %d sequences dropped, "
                            "the pool reset", who, request.epoch, before[0], before[1])
            else:
                log.info("model service %s registered epoch %d", who, request.epoch)
        c = m.config
        return pb.RegisterResponse(reset=reset, page_size=c.page_size, num_pages=c.num_pages,
                                   cpu_pages=c.cpu_pages, max_seqs=c.max_seqs)

    async def Step(self, request, context):
        return await self._step(request, context)

    async def StepStream(self, request_iterator, context):
        if self.step_streams is not None:
            self.step_streams.inc()
        try:
            async for request in request_iterator:
                yield await self._step(request, context)
        finally:
            if self.step_streams is not None:
                self.step_streams.dec()

    async def _step(self, request, context) -> pb.StepResponse:
        start = time.perf_counter()
        plan = await self._run(context, lambda: self.m.step(convert.step_request_from_pb(request)))
        out = convert.step_plan_to_pb(plan)
        self.step_seconds.observe(time.perf_counter() - start)
        return out

    async def CanAllocate(self, request, context):
        check = await self._run(context, lambda: self.m.can_allocate(convert.need_from_pb(request.need)))
        return convert.check_to_pb(check)

    async def Allocate(self, request, context):
        out = await self._run(context, lambda: self.m.try_allocate(convert.need_from_pb(request.need)))
        return convert.allocation_to_pb(out)

    async def Commit(self, request, context):
        stored = await self._run(context, lambda: self.m.commit(self._commit(request)))
        return pb.CommitResponse(pages_stored=stored)

    async def Release(self, request, context):
        freed, cached = await self._run(context, lambda: self.m.release(self._seq_id(request.seq)))
        return pb.ReleaseResponse(pages_freed=freed, pages_cached=cached)

    async def MatchPrefix(self, request, context):
        cached, hashes = await self._run(
            context, lambda: self.m.match_prefix(request.token_ids[:], request.extra_key))
        return pb.MatchPrefixResponse(cached_tokens=cached, page_hashes=hashes)

    async def Fork(self, request, context):
        out = await self._run(
            context, lambda: self.m.try_allocate(Fork(self._seq_id(request.parent, "parent"), request.request_id,
                                                    request.num_tokens)))
        return pb.ForkResponse(seq_id=out.result.seq_id, page_ids=out.result.page_ids,
                               copies=convert.copies_to_pb(out.copies))

    async def Truncate(self, request, context):
        pages, freed, copies = await self._run(
            context, lambda: self.m.truncate(self._seq_id(request.seq), request.num_tokens))
        return pb.TruncateResponse(page_ids=pages, pages_freed=freed, copies=convert.copies_to_pb(copies))

    async def SwapOut(self, request, context):
        copies = await self._run(context, lambda: self.m.swap_out(self._seq_id(request.seq)))
        return pb.SwapOutResponse(swap_out=convert.copies_to_pb(copies))

    async def SwapIn(self, request, context):
        out = await self._run(context, lambda: self.m.try_allocate(Resume(self._seq_id(request.seq))))
        return pb.SwapInResponse(page_ids=out.result.page_ids, swap_in=convert.copies_to_pb(out.swap_in))

    async def GetSequence(self, request, context):
        info = await self._run(context, lambda: self.m.sequence_info(self._seq_id(request.seq)))
        return convert.sequence_to_pb(info)

    async def GetStats(self, request, context):
        return convert.stats_to_pb(self.m.stats())

    async def Reset(self, request, context):
        await self._run(context, self.m.reset)
        return pb.ResetResponse()

    async def WatchEvents(self, request, context) -> AsyncIterator[pb.Event]:
        events = self._events
        reader = events.open()   # with the snapshot, in one go: it reads from the snapshot's number on
        try:
            if request.snapshot:
                yield convert.event_to_pb(self.m.snapshot())
            while not self._closing:
                batch = events.read(reader)
                for event in batch:
                    yield convert.event_to_pb(event)
                if not batch:
                    await self._wake.wait()
        finally:
            events.close(reader)
        await context.abort(grpc.StatusCode.UNAVAILABLE, "the KV-cache manager is shutting down")
