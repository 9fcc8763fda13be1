"""One Generate through the fleet: wait for a worker (telling the client its place in the
queue), forward the request, stream the worker's answer back, and when the worker fails
mid-stream, go on on another one from the tokens already streamed (GenerateRequest.continuation),
so the client sees neither a gap nor a repeat: one prefill_done, every token once, one finished.
A request of n > 1 sequences that fails after its first tokens goes on as one request per
sequence not yet finished, each continuing its own tokens with the seed that sequence draws with.

A worker fails when its call ends UNAVAILABLE (killed, draining past its grace period, its
manager lost for good) or RESOURCE_EXHAUSTED after it had sent something (not one marked
kvserve-final, the request's own: its client did not read), or when its load stream finds it
down (it failed or went silent: the call is cancelled here); a move costs one of
--migration-limit. RESOURCE_EXHAUSTED before anything came is the worker's queue full (it filled
before the gateway saw it): the request waits for room again and spends no move. Either way the
worker is held off until it reports again. Any other status is the request's own and reaches
the client as the worker gave it, with the trailers a client retries by (PASSED_TRAILERS).
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from contextlib import aclosing

import grpc

from kvserve.inference.v1 import inference_pb2 as pb
from kvserve.model_service.engine.errors import (ENDED_STOP_TOKEN_TRAILER, ENDED_STOP_TRAILER, ENDED_TRAILER,
                                                 FINAL_TRAILER, TAKEN_HEADER)
from kvserve.model_service.engine.family import child_seed
from kvserve.model_service.request_ids import MAX_REQUEST_ID_CHARS
from kvserve.model_service.status import status_message
from kvserve.services.gateway.fleet import Fleet, session_key
from kvserve.services.gateway.peer_addresses import without_addresses
from kvserve.services.gateway.router import Choice
from kvserve.services.gateway.waiting import QueueFull
from kvserve.services.gateway.worker import Worker
from kvserve.services.plumbing.api_keys import TENANT_METADATA
from kvserve.services.plumbing.retry_hints import NO_RETRY_TRAILER

log = logging.getLogger(__name__)

RETRYABLE = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED}

# A worker refusing a request as full (its own --max-waiting reached before the gateway saw it) is
# not a failure and costs no move; each refusal holds that worker off until its next report, and
# past this many the request is refused as the gateway's own full queue refuses it.
MAX_REFUSALS = 16
# A prompt this long is hashed on a thread: on the event loop its hashing would hold up every
# other stream's tokens (a 128k-token prompt hashes in about 10 ms).
HASH_OFF_LOOP_TOKENS = 4096
MAX_RENAMES = 3   # a moved request's id taken at the worker: tries under a fresh one
# A request whose prompt this many workers failed while computing it (they had taken it, their
# prefill_done had not come) goes to no other: it may be what kills them (a query of death), and
# --migration-limit moves would take down that many more. A worker failing mid-decode, the usual
# way, refusing the request before taking it (draining, unreachable), or failing while the request
# waited in its queue (its last `queued` said a place, not 0) counts nothing. (A worker sends its 0
# before the forward that computes the request; one killed before its loop wrote it counts as
# not computing it, and the request moves once more.)
PREFILL_FAILURES_LIMIT = 2
HEADERS_LOOK_S = 1.0   # a failed call's headers, asked for: there at once, or never
# A worker's trailers that a status passed on to the client keeps: what a client (or a gateway in
# front of this one) reads to retry, or not.
PASSED_TRAILERS = frozenset({FINAL_TRAILER, NO_RETRY_TRAILER, "retry-after-ms"})


def _too_large(exc: grpc.aio.AioRpcError) -> bool:
    """The worker's gRPC refused the message for its size (its --max-request-bytes)."""
    return exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "Received message larger than max" in (
        exc.details() or "")


def _already_ended(exc: grpc.aio.AioRpcError) -> int | None:
    """The finish reason when a worker refused a continuation this gateway made because the
    tokens it carries had already ended the sequence (its ENDED_TRAILER says how), else None:
    the worker that failed had sent its last token but not its end."""
    if exc.code() != grpc.StatusCode.INVALID_ARGUMENT:
        return None
    name = next((value for key, value in exc.trailing_metadata() or () if key == ENDED_TRAILER), None)
    if name is not None:
        return pb.FinishReason.Value(name) if name in pb.FinishReason.keys() else None
    # A worker of the release before the trailer says it only in words (a fleet mid-upgrade).
    details = exc.details() or ""
    if "leaves none to generate" in details or "fill the model length" in details:
        return pb.FINISH_REASON_LENGTH
    return pb.FINISH_REASON_STOP if "nothing left to generate" in details else None


def _ended_by(exc: grpc.aio.AioRpcError, request: pb.GenerateRequest) -> pb.Finished:
    """The Finished fields saying which stop ended the sequence, as the refusing worker's
    trailers tell it (the index of one of `request`'s stop strings, or a stop token id)."""
    trailers = dict(exc.trailing_metadata() or ())
    out = pb.Finished()
    index, token = _int(trailers.get(ENDED_STOP_TRAILER)), _int(trailers.get(ENDED_STOP_TOKEN_TRAILER))
    if index is not None and 0 <= index < len(request.sampling.stop):
        out.stop = request.sampling.stop[index]
    if token is not None and -2**31 <= token < 2**31:   # (an int32 field)
        out.stop_token_id = token
    return out


def _int(value: str | None) -> int | None:
    """A trailer's decimal integer; None for anything else (whatever a worker sends)."""
    return int(value) if isinstance(value, str) and re.fullmatch(r"-?[0-9]{1,10}", value) else None


def _failure(exc: grpc.aio.AioRpcError) -> str:
    """A worker's failure in the words its request's client may read. grpc's details (errno text,
    the worker's address, a lane's exception) are the log's."""
    if exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
        return "it ran out of room for the request"
    return "it became unavailable"


def _final(exc: grpc.aio.AioRpcError) -> bool:
    """The worker says its status is the request's own (FINAL_TRAILER: its client did not read),
    though the code alone would send it to another worker."""
    return any(key == FINAL_TRAILER for key, _ in exc.trailing_metadata() or ())


def none_serving(fleet: Fleet, waited_s: float) -> str:
    """What a call that waited --no-worker-timeout for a serving worker in vain is told."""
    return (f"no worker has been serving for {waited_s:g} s (--no-worker-timeout); try again later"
            f"{fleet.why_none_serving(addresses=False)}")


def renamed(request_id: str) -> str:
    """A moved request's id once another request holds it at the worker: a random suffix, within
    the length a worker allows."""
    suffix = "." + uuid.uuid4().hex[:8]
    return request_id[:MAX_REQUEST_ID_CHARS - len(suffix)] + suffix


class Refused(Exception):
    """The call ends with this status (and trailing metadata). Its message is the client's: a
    worker's grpc details quoted in it lose the addresses they name."""

    def __init__(self, code: grpc.StatusCode, message: str, trailers: tuple = ()) -> None:
        message = status_message(without_addresses(message))   # a header: past 16 KiB gRPC ends the call
        super().__init__(message)
        self.code, self.message, self.trailers = code, message, trailers


def unfit(fleet: Fleet, why: str, prompt_tokens: int, length: int = 0, output: str = "max_tokens",
          salted: bool = False) -> Refused:
    """The refusal of a request no serving worker can take (`why`: Fleet.never_fits):
    INVALID_ARGUMENT, or UNAVAILABLE where a worker not serving now could take it once it is back,
    so that a client's retry is not refused as if the request itself were wrong."""
    if fleet.fits_one_away(prompt_tokens, length, output, salted):
        # final: a gateway in front of this one passes it on, as it would INVALID_ARGUMENT, rather
        # than taking it for this gateway's failure and moving the request
        return Refused(grpc.StatusCode.UNAVAILABLE, f"no serving worker can take the request now ({why}); one "
                       "not serving now could once it is back: try again later", ((FINAL_TRAILER, "1"),))
    return Refused(grpc.StatusCode.INVALID_ARGUMENT, why)


class Relay:
    def __init__(self, fleet: Fleet, request: pb.GenerateRequest, request_id: str, ids: list[int],
                 migration_limit: int, no_worker_timeout_s: float = 30.0, tenant: str = "",
                 resumed: bool = False, avoid: Worker | None = None, prefill_failures: int = 0) -> None:
        self.no_worker_timeout_s = no_worker_timeout_s
        self.tenant = tenant   # whose prefix cache: in the hashes here, in metadata to the worker
        self._metadata = ((TENANT_METADATA, tenant),) if tenant else ()
        self.fleet = fleet
        self.request = request
        self.request_id = request_id
        self.ids = ids
        self.migration_limit = migration_limit
        self.worker: Worker | None = None     # the worker streaming it now
        self.routed = False                   # some worker has taken it (it holds or held room there)
        self.arrived = time.monotonic()       # its order among streams moving back to the queue's front
        self.cancelled = False                # Cancel(request_id) while it waited
        self.ended: str | None = None         # the gateway is stopping: end with this, UNAVAILABLE
        self._call = None
        self._moved = False
        self._waiter = None   # its place in the gateway's queue while it waits there
        self._resumed = resumed   # one sequence of a split request: its client has had prefill_done
        self._avoid = avoid       # the worker it left, chosen again only if no other can take it
        self._prefill_failures = prefill_failures   # a split's part: its request's, so far
        self._parts: list[Relay] = []   # a split request's sequences, each its own Relay (_split)

    def move_off(self, worker: Worker) -> None:
        """`worker` stopped answering: end the call to it; run() goes on elsewhere."""
        if self.worker is worker and self._call is not None:
            self._moved = True
            self._call.cancel()

    def end(self, why: str) -> None:
        """The gateway stops: the stream ends UNAVAILABLE with `why`, wherever it is."""
        self.ended = why
        for part in self._parts:
            part.end(why)
        if self._waiter is not None:
            self.fleet.queue.poke(self._waiter)
        if self._call is not None:
            self._call.cancel()

    async def cancel(self) -> None:
        """Cancel(request_id). Waiting here, it leaves the queue; on a worker, the worker cancels
        it and its stream ends ABORT with the usage so far. A worker that does not know the id yet
        (routed a moment ago) or does not answer within worker.CANCEL_TIMEOUT_S has the call to it ended
        here instead, and the stream ends ABORT all the same. Either way it goes nowhere else."""
        self.cancelled = True
        if self._parts:
            await asyncio.gather(*(part.cancel() for part in self._parts))
            return
        if self._waiter is not None:   # only it has something new to look at
            self.fleet.queue.poke(self._waiter)
        worker = self.worker
        if worker is None:
            return
        try:
            await worker.cancel(self.request_id, self._metadata)   # the worker checks the tenant
        except grpc.aio.AioRpcError as exc:
            log.info("request %s: the worker's Cancel failed (%s); ending its call here", self.request_id,
                     exc.code().name)
            if self._call is not None:
                self._call.cancel()

    async def run(self, time_left) -> AsyncIterator[pb.GenerateResponse]:
        fleet = self.fleet
        hashes: dict[int | None, list[int]] = {}

        def hashes_for() -> list[int]:   # once per page size (known once a worker has answered)
            ps = fleet.page_size
            if ps not in hashes:
                hashes[ps] = fleet.hashes(self.ids, self.tenant, cache_salt=self.request.cache_salt)
            return hashes[ps]

        streamed: dict[int, list[int]] = {}   # each sequence's tokens so far, by index
        finished: set[int] = set()             # the sequences that have ended
        prefill_sent = self._resumed
        first_cached = 0   # prompt tokens from the cache at the first worker, as prefill_done said
        n = self.request.sampling.n or 1
        left = n   # sequences to finish: the call ends after the last
        moves = renames = refusals = 0
        rerouted = False   # its worker was removed between the choice and the send
        prefill_failures = self._prefill_failures   # workers that failed with it taken, before computing its prompt
        avoid = self._avoid

        # Tokens a gateway in front of this one streamed before it moved the request here: a move
        # from here goes on after them and after ours.
        earlier = list(self.request.continuation.ids)

        def aborted() -> Iterator[pb.GenerateResponse]:
            """Cancelled here (while it waited or moved, or on a worker that did not know it yet):
            each sequence not yet finished ends ABORT with its usage so far, as a worker ends them."""
            for i in range(n):
                if i not in finished:
                    usage = pb.Usage(prompt_tokens=len(self.ids), cached_tokens=first_cached,
                                     completion_tokens=len(streamed.get(i, ())) + (len(earlier) if n == 1 else 0))
                    yield pb.GenerateResponse(finished=pb.Finished(finish_reason=pb.FINISH_REASON_ABORT, usage=usage),
                                              index=i)

        # what a worker's model length must hold: the prompt and every token it may generate (the
        # continuation's among them), or, max_tokens unset, one and min_tokens (a worker refuses
        # min_tokens past what its model length leaves; a fleet may mix --max-model-len)
        sampling, salted = self.request.sampling, bool(self.request.cache_salt)
        if sampling.HasField("max_tokens"):
            output, length = "max_tokens", len(self.ids) + sampling.max_tokens
        else:
            output, length = "min_tokens", len(self.ids) + max(1, sampling.min_tokens)

        def route() -> Choice | None:
            continued = len(earlier) + len(streamed.get(0, []))
            need, asked = length, output
            if output == "min_tokens" and len(self.ids) + continued + 1 > length:
                # max_tokens unset, a moved stream needs room for what it streamed and a token more
                need, asked = len(self.ids) + continued + 1, "the tokens streamed and one more"
            # a queue's head that no worker can take would stall it
            why = fleet.never_fits(len(self.ids), need, asked, salted)
            if why is not None and prefill_sent:
                raise Refused(grpc.StatusCode.UNAVAILABLE, f"no serving worker can go on with the request: {why}")
            if why is not None:
                raise unfit(fleet, why, len(self.ids), need, asked, salted)
            session = session_key(self.tenant, self.request.session_id)
            return fleet.choose(self.ids, hashes_for(), session, avoid, need, n, salted, asked, continued=continued)

        if fleet.page_size and len(self.ids) >= HASH_OFF_LOOP_TOKENS:
            ps = fleet.page_size
            hashes[ps] = await asyncio.to_thread(fleet.hashes, self.ids, self.tenant, ps, self.request.cache_salt)
        while True:
            if self.cancelled:   # while it moved
                for response in aborted():
                    yield response
                return
            if self.ended is not None:   # the gateway stopped while it moved
                raise Refused(grpc.StatusCode.UNAVAILABLE, self.ended)
            choice = None
            # A moved stream waits at the head of the queue, and its client is not told: to it the
            # stream only pauses.
            # closed on the way out, so that it leaves the queue even if run() is closed while it waits
            moved = prefill_sent or moves > 0 or refusals > 0 or rerouted
            async with aclosing(self._acquire(route, front=moved)) as acquired:
                async for item in acquired:
                    if isinstance(item, Choice):
                        choice = item
                    elif not moved:
                        yield item
            if choice is None:   # cancelled while it waited
                for response in aborted():
                    yield response
                return
            if self.cancelled or self.ended is not None:   # while its client was told it reached the head
                choice.worker.ended(choice.mark)   # never sent: the top of the loop ends it
                continue
            worker = choice.worker
            if worker.closed:   # removed (and its channel closed) while this request was on its way
                worker.ended(choice.mark)   # there, as it told its client its place: it goes elsewhere
                rerouted = True
                continue
            msg = self.request   # the client's own message, forwarded as it is but for these two
            msg.request_id = self.request_id
            if streamed:   # one sequence here: a request of n > 1 with tokens streamed has split
                del msg.continuation.ids[:]
                msg.continuation.ids.extend(earlier + streamed.get(0, []))
            if prefill_sent:   # the client has the prompt's logprobs: not computed again (nor the cache skipped)
                msg.sampling.ClearField("prompt_logprobs")
            self.worker, self._moved, self.routed = worker, False, True
            self._call = call = worker.generate(msg, timeout=time_left(), metadata=self._metadata)
            here = left   # its sequences unfinished on this worker
            worker.stream_started(self, here)
            taken = asyncio.ensure_future(_note_taken(call, choice.mark))
            answered = full = False   # the worker sent something; it refused the request as full
            prefilled_here = False    # this worker computed the prompt (its prefill_done came)
            waiting_here = False      # it waits in this worker's queue (its last `queued` said a place)
            try:
                async for response in call:
                    answered = True
                    worker.events_heard += 1
                    kind = response.WhichOneof("event")
                    if kind == "queued":
                        waiting_here = response.queued.position > 0
                        if moved:   # to its client a moved stream only pauses
                            continue
                    elif kind == "prefill_done":
                        prefilled_here = True
                        worker.prefilled(choice.mark)
                        # the worker took it: its prompt and hits count now (not a request it refused)
                        worker.prompt_tokens += response.prefill_done.prompt_tokens
                        worker.hit_tokens += response.prefill_done.cached_tokens
                        if prefill_sent:
                            continue
                        prefill_sent = True
                        first_cached = response.prefill_done.cached_tokens
                        fleet.prompt_tokens += response.prefill_done.prompt_tokens
                        fleet.cached_tokens += first_cached
                    elif kind == "chunk":
                        streamed.setdefault(response.index, []).extend(response.chunk.token_ids)
                        fleet.generated_tokens += len(response.chunk.token_ids)
                    elif kind == "finished" and moves:   # the usage says what the client was told first
                        response.finished.usage.cached_tokens = first_cached
                    yield response
                    if kind == "finished":
                        finished.add(response.index)
                        left -= 1
                        here -= 1
                        worker.sequence_ended()
                        if not left:
                            return
                return
            except grpc.aio.AioRpcError as exc:
                if self.cancelled:   # Cancel was answered; the worker failing after it changes nothing
                    for response in aborted():
                        yield response
                    return
                if exc.code() == grpc.StatusCode.ALREADY_EXISTS and (moves or self._resumed) and renames < MAX_RENAMES:
                    # the id is this gateway's doing (a split's part, or a move) and another request
                    # holds it there: the same request under an id of its own, not a move
                    renames += 1
                    self.request_id = renamed(self.request_id)
                    continue
                reason = _already_ended(exc) if (moves or self._resumed) else None
                if reason is not None:   # the worker failed between the sequence's last token and its end
                    usage = pb.Usage(prompt_tokens=len(self.ids), cached_tokens=first_cached,
                                     completion_tokens=len(earlier) + len(streamed.get(0, [])))
                    end = _ended_by(exc, self.request)
                    end.finish_reason = reason
                    end.usage.CopyFrom(usage)
                    yield pb.GenerateResponse(finished=end, index=0)
                    return
                if _too_large(exc) and not self._moved:   # as large at any worker: no move helps
                    raise Refused(exc.code(), f"the request is larger than the workers take ({exc.details()})") \
                        from None
                if (exc.code() not in RETRYABLE or _final(exc)) and not self._moved:
                    kept = tuple((key, value) for key, value in exc.trailing_metadata() or () if key in PASSED_TRAILERS)
                    raise Refused(exc.code(), exc.details(), kept) from None
                why = f"{exc.code().name}: {exc.details()}"   # the log's; `told`, the client's
                told = "it stopped answering" if self._moved else _failure(exc)
                full = exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and not answered and not self._moved
            except asyncio.CancelledError:
                task = asyncio.current_task()
                if task is not None and task.cancelling():
                    raise
                if self.ended is not None:
                    raise Refused(grpc.StatusCode.UNAVAILABLE, self.ended) from None
                if self.cancelled:   # cancel() ended the call here
                    for response in aborted():
                        yield response
                    return
                if not self._moved:
                    raise
                why = told = "it stopped answering"
            finally:
                taken.cancel()
                worker.stream_ended(self, here, choice.mark)
                self.worker, self._call = None, None
                call.cancel()
            worker.hold_off()   # not chosen again before it reports after this
            avoid = worker
            if full:   # its queue was full, not the worker failing: the request waits for room, no move spent
                refusals += 1
                if refusals > MAX_REFUSALS:
                    raise Refused(grpc.StatusCode.RESOURCE_EXHAUSTED, f"the workers refused the request as full "
                                  f"{refusals} times ({told}); try again later", (("retry-after-ms", "1000"),))
                log.info("request %s: worker %s is full (%s); it waits for room", self.request_id, worker.address, why)
                continue
            if not prefilled_here and not waiting_here and await _admitted(call):
                prefill_failures += 1
                if prefill_failures >= PREFILL_FAILURES_LIMIT:
                    log.warning("request %s: worker %s failed (%s) before computing its prompt, as %d workers have; "
                                "it goes to no other", self.request_id, worker.address, why, prefill_failures)
                    raise Refused(grpc.StatusCode.INTERNAL,
                                  f"{prefill_failures} workers failed while computing the request's prompt "
                                  f"(the last: {told}); it is sent to no other, in case it is what makes them fail",
                                  ((NO_RETRY_TRAILER, "1"),))
            if moves >= self.migration_limit:   # (the workers' addresses are the log's, not the client's)
                log.warning("request %s: worker %s failed (%s); it has moved %d times, as many as "
                            "--migration-limit allows", self.request_id, worker.address, why, moves)
                raise Refused(grpc.StatusCode.UNAVAILABLE,
                              f"a worker failed before the request finished ({told}); it has moved "
                              f"{moves} times, as many as --migration-limit allows")
            moves += 1
            worker.migrated_away += 1
            self.fleet.migrations += 1
            log.warning("request %s: worker %s failed (%s); going on elsewhere from %d streamed tokens (move %d)",
                        self.request_id, worker.address, why, sum(map(len, streamed.values())), moves)
            if streamed and n > 1:   # a continuation goes on one sequence: one request for each
                async with aclosing(self._split(streamed, finished, first_cached, worker, time_left,
                                                self.migration_limit - moves, prefill_failures)) as parts:
                    async for response in parts:
                        yield response
                return

    async def _split(self, streamed: dict[int, list[int]], finished: set[int], first_cached: int,
                     failed: Worker, time_left, moves_left: int,
                     prefill_failures: int = 0) -> AsyncIterator[pb.GenerateResponse]:
        """A request of n > 1 sequences goes on as one request per sequence not yet finished, each
        continuing its own tokens and drawing with the seed its sequence draws with (child_seed),
        so greedy and seeded output is what one worker would have streamed. Each part moves on its
        own, up to `moves_left` times (and PREFILL_FAILURES_LIMIT counted on from the request's
        `prefill_failures`); their events reach the client under their sequence's index,
        the usage's cache hit the one the client was told first."""
        indices: list[int] = []   # the sequence each part goes on
        for i in range(self.request.sampling.n):
            if i in finished:
                continue
            msg = pb.GenerateRequest()
            msg.CopyFrom(self.request)
            msg.sampling.n = 1
            msg.sampling.ClearField("prompt_logprobs")   # the client has had prefill_done
            if msg.sampling.HasField("seed"):
                msg.sampling.seed = child_seed(msg.sampling.seed, i)
            del msg.continuation.ids[:]
            msg.continuation.ids.extend(streamed.get(i, []))
            # the worker's id for it, within the length a worker allows, and random: a client could
            # send `<id>.<i>` of its own
            suffix = f".{i}.{uuid.uuid4().hex[:8]}"
            part_id = self.request_id[:MAX_REQUEST_ID_CHARS - len(suffix)] + suffix
            part = Relay(self.fleet, msg, part_id, self.ids, moves_left, self.no_worker_timeout_s, self.tenant,
                         resumed=True, avoid=failed, prefill_failures=prefill_failures)
            part.arrived = self.arrived   # its request's place among streams moving back
            part.cancelled = self.cancelled   # a Cancel while it moved: each part ends ABORT at once
            part.ended = self.ended
            self._parts.append(part)
            indices.append(i)
        # Bounded: a client that does not read holds the pumps, so the parts' workers see it (their
        # --max-unread-tokens) instead of this gateway keeping what they send.
        events: asyncio.Queue = asyncio.Queue(maxsize=4 * len(indices))

        async def pump(index: int, part: Relay) -> None:
            try:
                async with aclosing(part.run(time_left)) as responses:
                    async for response in responses:
                        await events.put((index, response, None))
            except Exception as exc:   # Refused, or a worker's own status: it ends the whole call
                await events.put((index, None, exc))
            else:
                await events.put((index, None, None))

        pumps = [asyncio.ensure_future(pump(i, part)) for i, part in zip(indices, self._parts)]
        try:
            running = len(pumps)
            while running:
                index, response, error = await events.get()
                if response is None:
                    if error is not None:
                        raise error
                    running -= 1
                    continue
                kind = response.WhichOneof("event")
                if kind not in ("chunk", "finished"):   # the client has had its prefill_done
                    continue
                out = pb.GenerateResponse()
                out.CopyFrom(response)
                out.index = index
                if kind == "finished":
                    out.finished.usage.cached_tokens = first_cached
                yield out
        finally:
            for task in pumps:
                task.cancel()
            await asyncio.gather(*pumps, return_exceptions=True)

    async def _acquire(self, route, front: bool = False) -> AsyncIterator[Choice | pb.GenerateResponse]:
        """A worker now, or a place in the queue until one has room (queued events meanwhile).
        Yields nothing more when the request is cancelled while it waits."""
        queue = self.fleet.queue
        # (a stream moving back goes ahead of the queue, but not of those moving back before it)
        if (not len(queue) or (front and not queue.fronts_before(self.arrived))) and (choice := route()) is not None:
            if not front:
                queue.passed()
            yield choice
            return
        try:
            self._waiter = waiter = queue.enter(self.request_id, front, self.arrived)
        except QueueFull as exc:
            eta = queue.eta_ms(len(queue) + 1)
            raise Refused(grpc.StatusCode.RESOURCE_EXHAUSTED, f"{exc}; try again later",
                          (("retry-after-ms", str(max(eta, 1000))),)) from None
        try:
            told = None
            loop = asyncio.get_running_loop()
            alone_since = None   # when it last saw no worker serving
            while not self.cancelled:
                if self.ended is not None:
                    raise Refused(grpc.StatusCode.UNAVAILABLE, self.ended)
                if len(self.fleet.board):
                    alone_since = None
                elif alone_since is None:
                    alone_since = loop.time()
                elif loop.time() - alone_since > self.no_worker_timeout_s:
                    raise Refused(grpc.StatusCode.UNAVAILABLE, none_serving(self.fleet, self.no_worker_timeout_s))
                position = queue.position(waiter)
                if position == 1 and (choice := route()) is not None:
                    queue.leave(waiter)
                    if told not in (None, 1):   # a client told its place sees it reach the head
                        try:
                            yield pb.GenerateResponse(queued=pb.QueueStatus(position=1, eta_ms=0))
                        except BaseException:   # it left there: the worker chosen was never sent it
                            choice.worker.ended(choice.mark)
                            raise
                    yield choice
                    return
                if position != told:
                    told = position
                    yield pb.GenerateResponse(queued=pb.QueueStatus(position=position,
                                                                    eta_ms=queue.eta_ms(position)))
                await queue.changed(waiter, timeout_s=1.0)
        finally:
            self._waiter = None
            queue.leave(waiter)


async def _admitted(call) -> bool:
    """Whether the worker had taken the failed call in (its TAKEN_HEADER came). Asked of the call
    once it has ended, when it has its headers, or never will, at once (headers that came in the
    same read as the failure included, which _note_taken may not have seen yet)."""
    look = asyncio.ensure_future(call.initial_metadata())
    try:
        await asyncio.wait({look}, timeout=HEADERS_LOOK_S)
    finally:
        look.cancel()
    if not look.done() or look.cancelled() or look.exception() is not None:
        return False
    return any(key == TAKEN_HEADER for key, _ in look.result() or ())


async def _note_taken(call, mark) -> None:
    """The worker sends its response headers as it takes a request in (or with its first message):
    from then its load reports count it (Routing.take)."""
    try:
        await call.initial_metadata()
    except (grpc.aio.AioRpcError, asyncio.CancelledError):
        return
    mark.take()
