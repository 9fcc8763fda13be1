"""kvserve.inference.v1.Inference on the gateway: the workers' API, so every client works
unchanged. Generate goes through the fleet (relay.py); Cancel follows the request to its worker
(another replica's is asked of every worker);
Tokenize and Detokenize answer here, with the workers' tokenizer; GetModelInfo is a worker's; GetServerStats
(and WatchServerStats, as it changes) sums the workers and lists each."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from contextlib import aclosing

import grpc

from kvserve.inference.v1 import inference_pb2 as pb
from kvserve.inference.v1 import inference_pb2_grpc as pb_grpc
from kvserve.services.gateway.fleet import Fleet
from kvserve.model_service.engine.errors import QueueFull
from kvserve.model_service.sampling.params import MAX_N
from kvserve.kvcache_service.contract.hashing import check_cache_salt
from kvserve.model_service.request_ids import CANCELLED_ID_WAIT_S, LEFT_CALL_WAIT_S, id_problem
from kvserve.model_service.status import status_message
from kvserve.services.gateway.inputs import InputError, Inputs
from kvserve.services.gateway.relay import Refused, Relay, none_serving, unfit
from kvserve.services.plumbing import stats_watch
from kvserve.services.plumbing.api_keys import TENANT_METADATA, ApiKeys, bearer_token

log = logging.getLogger(__name__)

# A call past its deadline that grpc has not ended yet is given this long to be, before it is
# ended here DEADLINE_EXCEEDED.
DEADLINE_END_WAIT_S = 0.5
MODEL_INFO_LOOK_S = 0.05   # how often GetModelInfo looks for a serving worker while none is

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Inference"].full_name
# How a stream the gateway took can fail (no worker, its worker lost past --migration-limit, a
# worker's fault), as a worker counts its requests_failed
FAULTS = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN,
                    grpc.StatusCode.DATA_LOSS})


def _timed(finished: pb.Finished, arrival: float, first_token_at: float | None) -> None:
    """A stream's times from its arrival here, its wait in the queue and every worker it ran on
    counted: a worker's own cover its call only (a moved stream's, the last worker's part)."""
    finished.total_ms = 1e3 * (time.monotonic() - arrival)
    if first_token_at is not None:   # (none streamed: the worker's, if it says one)
        finished.ttft_ms = 1e3 * (first_token_at - arrival)


class GatewayServicer(pb_grpc.InferenceServicer):
    def __init__(self, fleet: Fleet, inputs: Inputs, migration_limit: int, no_worker_timeout_s: float = 30.0,
                 keys: ApiKeys | None = None, max_n: int = MAX_N) -> None:
        self.no_worker_timeout_s = no_worker_timeout_s
        self.max_n = max_n   # the workers' --max-n: a request's n is its sequences' count here too
        self.keys = keys   # --api-keys: each key's tenant has its own prefix cache at the workers
        self.fleet = fleet
        self.inputs = inputs
        self.migration_limit = migration_limit
        self.relays: dict[tuple[str, str], Relay] = {}   # (tenant, request id): each tenant's ids are its own
        self._streams_over: dict[tuple[str, str], asyncio.Event] = {}   # set as its relay leaves `relays`
        self.draining = False
        self._shared_stats = stats_watch.SharedStats(self._built_stats, self._load)   # WatchServerStats' messages
        self._load_key: tuple[float, tuple] | None = None   # (when, _load()'s key then)

    async def Generate(self, request, context):
        arrival = time.monotonic()
        request_id = request.request_id or uuid.uuid4().hex
        try:
            tenant = self._tenant(context)
            if self.draining:
                raise Refused(grpc.StatusCode.UNAVAILABLE, "the gateway is draining: it takes no new requests")
            if (problem := id_problem(request_id, request.session_id)) is not None:
                raise Refused(grpc.StatusCode.INVALID_ARGUMENT, problem)   # what its worker would refuse
            if request.sampling.n > self.max_n:   # before it waits, or is counted n times on a worker's load
                raise Refused(grpc.StatusCode.INVALID_ARGUMENT, f"n must be an integer in [1, {self.max_n}] "
                                                                f"(--max-n), got {request.sampling.n}")
            try:
                check_cache_salt(request.cache_salt)
            except ValueError as exc:
                raise Refused(grpc.StatusCode.INVALID_ARGUMENT, str(exc)) from None
            if request.WhichOneof("input") == "token_ids" and \
                    (why := self.fleet.never_fits(len(request.token_ids.ids))) is not None:
                raise unfit(self.fleet, why, len(request.token_ids.ids))   # before a list of them is made
            try:
                ids = await self.inputs.ids(request)
            except InputError as exc:
                raise Refused(grpc.StatusCode.INVALID_ARGUMENT, str(exc)) from None
            except QueueFull as exc:   # the long-text lane is full
                raise Refused(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc)) from None
            await self._cancelled_one_ended(tenant, request_id)
            if self.draining:   # again: a drain may have begun while it waited
                raise Refused(grpc.StatusCode.UNAVAILABLE, "the gateway is draining: it takes no new requests")
            if (tenant, request_id) in self.relays:   # checked after the awaits, where another could have come
                raise Refused(grpc.StatusCode.ALREADY_EXISTS, f"request id {request_id!r} is already in flight")
        except Refused as exc:
            self.fleet.refused[exc.code.name] += 1
            if exc.trailers:
                context.set_trailing_metadata(exc.trailers)
            await context.abort(exc.code, exc.message)
        relay = Relay(self.fleet, request, request_id, ids, self.migration_limit, self.no_worker_timeout_s, tenant)
        self.relays[tenant, request_id] = relay
        self._streams_over[tenant, request_id] = asyncio.Event()
        ended = "aborted"   # unless it runs to its end: the client went away
        streamed = False   # a response went out: a refusal after it is a failure, not a refusal
        try:
            # closed here, not whenever it is collected, if the client goes away while this waits to send
            first_token_at: dict[int, float] = {}   # each sequence's (n > 1: each choice's own)
            async with aclosing(relay.run(context.time_remaining)) as responses:
                async for response in responses:
                    streamed = True
                    if response.chunk.token_ids and response.index not in first_token_at:
                        first_token_at[response.index] = time.monotonic()
                    elif response.HasField("finished"):   # timed from this call: the one its client made
                        _timed(response.finished, arrival, first_token_at.get(response.index))
                    yield response
            ended = "aborted" if relay.cancelled else "finished"
        except Refused as exc:   # a request refused (its input, a full queue) neither ran nor failed
            if exc.code == grpc.StatusCode.DEADLINE_EXCEEDED:
                # the client's own deadline (the worker's call carries it), met there first: the
                # client left, as a worker counts it. Once it has passed here too, grpc ends the
                # call itself (cancelling this handler), and an abort of a finished call logs a
                # traceback; returning instead would end it OK, cut short, if grpc has not yet.
                ended = "aborted"
                left = context.time_remaining()
                if left is not None and left <= 0:
                    if not context.done():
                        await asyncio.sleep(DEADLINE_END_WAIT_S)   # cancelled here as grpc ends it
                    if context.done():
                        return
            else:
                ended = "failed" if exc.code in FAULTS or streamed else None
                if ended is None:
                    self.fleet.refused[exc.code.name] += 1
            if exc.trailers:
                context.set_trailing_metadata(exc.trailers)
            await context.abort(exc.code, exc.message)
        finally:
            del self.relays[tenant, request_id]
            self._streams_over.pop((tenant, request_id)).set()
            if ended is not None:
                self.fleet.ended[ended] += 1
            if relay.routed:   # room freed at a worker: what the queue's wait estimate counts
                self.fleet.queue.stream_ended()

    async def _cancelled_one_ended(self, tenant: str, request_id: str) -> None:
        """A client that cancelled a request here (Cancel answered) and sends its id again is served
        once the cancelled stream has ended (its worker's ABORT relayed: moments), not told the id
        is in flight, as a worker serves it. A client that left its call frees the id as the
        call's handler unwinds, a few loop turns after grpc ended the call (which its context
        does not show): any other holder is waited for LEFT_CALL_WAIT_S, and one still running
        keeps its id. (A Cancel answered by another gateway replica is not seen here: the id is
        in flight until the worker's ABORT reaches this one.)"""
        key = (tenant, request_id)
        relay = self.relays.get(key)
        if relay is None:
            return
        over = self._streams_over[key]
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(over.wait(), LEFT_CALL_WAIT_S)
            return
        if relay.cancelled:   # (a Cancel may have come meanwhile)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(over.wait(), CANCELLED_ID_WAIT_S)

    def _tenant(self, context) -> str:
        if self.keys is None:
            return ""
        tenant = self.keys.tenant(bearer_token(context.invocation_metadata()))
        if tenant is None:   # the key left the file since the interceptor saw it (SIGHUP)
            raise Refused(grpc.StatusCode.UNAUTHENTICATED, "unknown API key")
        return tenant

    async def Cancel(self, request, context):
        try:
            tenant = self._tenant(context)
        except Refused as exc:
            await context.abort(exc.code, exc.message)
        relay = self.relays.get((tenant, request.request_id))   # another tenant's is not there for this one
        if relay is not None:
            await relay.cancel()
            return pb.CancelResponse()
        # an id Generate refuses is in flight nowhere: not passed on to the workers
        if id_problem(request.request_id) is not None or \
                not await self._cancel_at_workers(request.request_id, tenant):
            shown = request.request_id[:64] + ("..." if len(request.request_id) > 64 else "")
            await context.abort(grpc.StatusCode.NOT_FOUND, f"no request {shown!r} in flight")
        return pb.CancelResponse()

    async def _cancel_at_workers(self, request_id: str, tenant: str) -> bool:
        """A request this replica does not stream may be another gateway's, behind the same Service:
        each serving worker is asked to cancel it (as the tenant, which the worker checks), and the
        replica streaming it ends it ABORT as the worker does. True if one had it."""
        metadata = ((TENANT_METADATA, tenant),) if tenant else ()

        async def ask(worker) -> bool:
            try:
                await worker.cancel(request_id, metadata)
                return True
            except grpc.aio.AioRpcError:
                return False

        return any(await asyncio.gather(*(ask(w) for w in self.fleet.serving())))

    async def Tokenize(self, request, context):
        add_special = request.add_special_tokens if request.HasField("add_special_tokens") else True
        try:
            ids = await self.inputs.ids(request, add_special)
            tokens = await self.inputs.tokens(ids)   # on the long lane for a long prompt, which may be full
        except InputError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, status_message(exc))
        except QueueFull as exc:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
        return pb.TokenizeResponse(token_ids=ids, tokens=tokens)

    async def Detokenize(self, request, context):
        try:
            model = self.fleet.model   # its vocabulary's padding rows are ids too (None: the tokenizer's alone)
            text = await self.inputs.text(request, model.vocab_size if model is not None else 0)
        except InputError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, status_message(exc))
        except QueueFull as exc:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
        return pb.DetokenizeResponse(text=text)

    async def GetModelInfo(self, request, context):
        """A serving worker's; while none is, waited for as a request waits (--no-worker-timeout,
        within the call's deadline), so that a client's first call in a restart of every worker,
        or the HTTP front's, is answered once one serves rather than refused at once."""
        loop = asyncio.get_running_loop()
        give_up = loop.time() + self.no_worker_timeout_s
        while (info := next((w.info for w in self.fleet.serving() if w.info is not None), None)) is None:
            if self.draining or loop.time() >= give_up:
                await context.abort(grpc.StatusCode.UNAVAILABLE, "the gateway is draining" if self.draining else
                                    none_serving(self.fleet, self.no_worker_timeout_s))
            await asyncio.sleep(MODEL_INFO_LOOK_S)
        return info

    async def GetServerStats(self, request, context):
        return self._stats()

    async def WatchServerStats(self, request, context):
        async for out in stats_watch.watch(request, context, self._shared_stats,
                                           done=lambda: self.draining and not self.relays, keys=self.keys):
            yield out

    def _load(self) -> tuple:
        """What a WatchServerStats message is sent for when it changes: each worker's pages in a
        worker's own steps (pages_key), as exact counts changed with every report and every
        stream rebuilt the whole fleet's stats at almost every look. Worked out once for the
        streams that look within MIN_INTERVAL_MS (a look walks the whole fleet)."""
        now = time.monotonic()
        if self._load_key is not None and now - self._load_key[0] < stats_watch.MIN_INTERVAL_MS / 1e3:
            return self._load_key[1]
        pages = self.fleet.page_size or 1   # (none before a worker's model is known: then nothing is ahead)
        key = (len(self.fleet.queue), self._not_serving() == "", *(
            (w.address, w.state, w.load.running, w.load.waiting,
             stats_watch.pages_key(w.load.free_pages + w.load.cached_pages, w.info.num_pages if w.info else 0),
             stats_watch.prefill_key(w.load.prefill_tokens, pages))
            for w in self.fleet.workers.values()))
        self._load_key = (now, key)
        return key

    async def _built_stats(self) -> pb.ServerStats:
        return self._stats()

    def _not_serving(self) -> str:
        if self.draining:
            return "the gateway is draining"
        return "" if self.fleet.serving() else "no worker is serving" + self.fleet.why_none_serving()

    def _stats(self) -> pb.ServerStats:
        workers = list(self.fleet.workers.values())
        not_serving = self._not_serving()
        ended = self.fleet.ended
        out = pb.ServerStats(queued=len(self.fleet.queue), manager_reachable=bool(self.fleet.serving()),
                             generated_tokens=self.fleet.generated_tokens, prompt_tokens=self.fleet.prompt_tokens,
                             cached_tokens=self.fleet.cached_tokens, requests_finished=ended["finished"],
                             requests_aborted=ended["aborted"], requests_failed=ended["failed"],
                             serving=not not_serving, not_serving=not_serving, gateway=True)
        for w in workers:
            row = w.stats(self.fleet.index.pages_of(w.address))
            out.workers.append(row)
            if not w.excluded:   # the fleet's load: not that of workers it routes nothing to
                out.running += row.running
                out.waiting += row.waiting
                out.prefill_tokens += row.prefill_tokens   # as each row says it (the gateway's backlog)
        return out
