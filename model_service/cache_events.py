"""KVCacheEvents on the model service's address: WatchEvents relayed from this worker's manager.

The manager listens where only its model service reaches it (a Unix socket in the pod); its
event stream is what a gateway needs to know this worker's cache. Relaying it here keeps the
manager's write RPCs private, needs no second port, and lets a gateway that knows a worker's
address find its events at the same address. One upstream stream per subscriber, at most
MAX_STREAMS at once: a fleet has a handful of gateways, and each event is a few hashes.

A snapshot is the costly part: the manager walks its whole tree on the loop every Step waits
on. So snapshots go upstream one at a time, each client address may ask SNAPSHOT_BURST of them
at once and then one every SNAPSHOT_REFILL_S, and one address holds at most
MAX_STREAMS_PER_ADDRESS streams: a caller opening and cancelling snapshot streams in a loop would
otherwise stall the manager's Steps.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time

import grpc

from kvserve.kvcache.v1 import kvcache_pb2 as kv_pb
from kvserve.kvcache.v1 import kvcache_pb2_grpc as kv_pb_grpc
from kvserve.services.plumbing.grpc_server import MAX_MESSAGE_BYTES
from kvserve.services.plumbing.stats_watch import AddressCounts, client_address
from kvserve.services.plumbing.tls import ClientTLS, aio_channel

log = logging.getLogger(__name__)

SERVICE_NAME = kv_pb.DESCRIPTOR.services_by_name["KVCacheEvents"].full_name
SHUTTING_DOWN = "this worker is shutting down: its event stream ends here"
MAX_STREAMS = 64   # relayed at once: a fleet has a handful of gateway replicas, each following once
MAX_STREAMS_PER_ADDRESS = 8   # a gateway follows a worker once; a few replicas may share an address
# A gateway asks for a snapshot when it starts following and again only when it starts over (a
# gap, a lost stream, a new epoch): rarely, and a refused one is asked again after a backoff.
SNAPSHOT_BURST, SNAPSHOT_REFILL_S = 4, 5.0
SNAPSHOT_WAIT_S = 30.0   # for the manager's snapshot, holding the one place upstream


class CacheEventsServicer(kv_pb_grpc.KVCacheEventsServicer):
    def __init__(self, kvcache: str, tls: ClientTLS | None = None, token: str = "") -> None:
        """`kvcache`: the manager's address, or "inprocess" (then there is nothing to relay);
        `token`: its admin token, for a manager beyond this pod (WatchEvents shows its pages)."""
        self._channel = None if kvcache == "inprocess" else aio_channel(kvcache, tls, [
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES)])   # a snapshot of a large cache is one message
        self._metadata = (("authorization", f"Bearer {token}"),) if token else ()
        self._calls: set = set()
        self._closing = False
        self.max_streams = MAX_STREAMS
        self._by_address = AddressCounts()
        self._snapshot_credit: dict[str, tuple[float, float]] = {}   # client address -> (credit, at)
        self._snapshots = asyncio.Semaphore(1)        # in flight upstream

    async def WatchEvents(self, request, context):
        if self._channel is None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                "this worker's KV-cache manager runs in-process (--kvcache inprocess) and "
                                "publishes no events; run it as its own process for a gateway to follow its cache")
        if self._closing:
            await context.abort(grpc.StatusCode.UNAVAILABLE, SHUTTING_DOWN)
        if len(self._calls) >= self.max_streams:   # each is a stream at the manager, every event sent to each
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                f"this worker already relays {self.max_streams} event streams, as many as it "
                                "serves at once; a gateway needs one")
        address = client_address(context.peer())
        if self._by_address[address] >= MAX_STREAMS_PER_ADDRESS:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                f"{MAX_STREAMS_PER_ADDRESS} event streams are open from this client's address, as "
                                "many as one address may hold; a gateway needs one")
        if request.snapshot:
            await self._space_snapshot(address, context)
        call = kv_pb_grpc.KVCacheManagerStub(self._channel).WatchEvents(request, metadata=self._metadata)
        self._calls.add(call)
        self._by_address[address] += 1
        try:
            async for event in self._events(call, request.snapshot):
                yield event
        except grpc.aio.AioRpcError as exc:
            if not self._closing:
                log.warning("the KV-cache manager ended a relayed event stream: %s: %s", exc.code().name,
                            exc.details())
                await context.abort(grpc.StatusCode.UNAVAILABLE,
                                    f"this worker's KV-cache manager stopped its event stream "
                                    f"({exc.code().name}); subscribe again with a snapshot")
        except TimeoutError:
            log.warning("the KV-cache manager sent no snapshot in %g s", SNAPSHOT_WAIT_S)
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"this worker's KV-cache manager sent no snapshot "
                                                             f"in {SNAPSHOT_WAIT_S:g} s; subscribe again later")
        except asyncio.CancelledError:   # close() ended the upstream call; anything else goes on up
            if not self._closing or _being_cancelled():
                raise
        finally:
            self._calls.discard(call)
            self._by_address.leave(address)
            call.cancel()
        if self._closing:
            await context.abort(grpc.StatusCode.UNAVAILABLE, SHUTTING_DOWN)

    async def _space_snapshot(self, address: str, context) -> None:
        """RESOURCE_EXHAUSTED (with a retry hint) for a snapshot past the address's credit."""
        now = time.monotonic()
        for other, (credit, at) in list(self._snapshot_credit.items()):   # full again: forgotten
            if credit + (now - at) / SNAPSHOT_REFILL_S >= SNAPSHOT_BURST:
                del self._snapshot_credit[other]
        credit, at = self._snapshot_credit.get(address, (SNAPSHOT_BURST, now))
        credit = min(SNAPSHOT_BURST, credit + (now - at) / SNAPSHOT_REFILL_S)
        if credit < 1:
            wait_ms = math.ceil((1 - credit) * SNAPSHOT_REFILL_S * 1000)
            context.set_trailing_metadata((("retry-after-ms", str(wait_ms)),))
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                f"{SNAPSHOT_BURST} snapshots were asked from this client's address in the last "
                                f"moments; the next may come in {wait_ms / 1000:.1f} s")
        self._snapshot_credit[address] = (credit - 1, now)

    async def _events(self, call, snapshot: bool):
        """The upstream call's events; with a snapshot, holding the relay's one upstream snapshot
        place until it has come."""
        events = aiter(call)
        if snapshot:
            async with self._snapshots, asyncio.timeout(SNAPSHOT_WAIT_S):   # a wedged manager holds no place for ever
                first = await anext(events, None)
            if first is None:
                return
            yield first
        async for event in events:
            yield event

    async def close(self) -> None:
        """Ends every relayed stream UNAVAILABLE (before the server stops, which would cancel
        them with an error logged for each), then the channel to the manager."""
        if self._closing or self._channel is None:
            return
        self._closing = True
        for call in list(self._calls):
            call.cancel()
        for _ in range(100):   # each handler returns once it has its status out
            if not self._calls:
                break
            await asyncio.sleep(0.01)
        await self._channel.close()


def _being_cancelled() -> bool:
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0
