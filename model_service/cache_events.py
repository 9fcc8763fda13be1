"""KVCacheEvents on the model service's address: WatchEvents relayed from this worker's manager.

The manager listens where only its model service reaches it (a Unix socket in the pod); its
event stream is what a gateway needs to know this worker's cache. Relaying it here keeps the
manager's write RPCs private, needs no second port, and lets a gateway that knows a worker's
address find its events at the same address. One upstream stream per subscriber, at most
MAX_STREAMS at once: a fleet has a handful of gateways, and each event is a few hashes.
"""

from __future__ import annotations

import asyncio

import grpc

from kvserve.kvcache.v1 import kvcache_pb2 as kv_pb
from kvserve.kvcache.v1 import kvcache_pb2_grpc as kv_pb_grpc
from kvserve.services.plumbing.grpc_server import MAX_MESSAGE_BYTES
from kvserve.services.plumbing.tls import ClientTLS, aio_channel

SERVICE_NAME = kv_pb.DESCRIPTOR.services_by_name["KVCacheEvents"].full_name
SHUTTING_DOWN = "this worker is shutting down: its event stream ends here"
MAX_STREAMS = 64   # relayed at once: a fleet has a handful of gateway replicas, each following once


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
        call = kv_pb_grpc.KVCacheManagerStub(self._channel).WatchEvents(request, metadata=self._metadata)
        self._calls.add(call)
        try:
            async for event in call:
                yield event
        except grpc.aio.AioRpcError as exc:
            if not self._closing:
                await context.abort(grpc.StatusCode.UNAVAILABLE,
                                    f"this worker's KV-cache manager stopped its event stream ({exc.code().name}: "
                                    f"{exc.details()}); subscribe again with a snapshot")
        except asyncio.CancelledError:   # close() ended the upstream call; anything else goes on up
            if not self._closing or _being_cancelled():
                raise
        finally:
            self._calls.discard(call)
            call.cancel()
        if self._closing:
            await context.abort(grpc.StatusCode.UNAVAILABLE, SHUTTING_DOWN)

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
