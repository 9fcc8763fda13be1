"""KVCacheEvents on the model service's address: the worker's manager's events, relayed, each
with the epoch the worker registered; the relay ends UNAVAILABLE when the manager goes away,
and a worker with an in-process manager says it has none to relay."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from kvserve.inference.v1 import inference_pb2 as pb
from kvserve.inference.v1 import inference_pb2_grpc as pb_grpc
from kvserve.kvcache.v1 import kvcache_pb2 as kv_pb
from kvserve.kvcache.v1 import kvcache_pb2_grpc as kv_pb_grpc
from kvserve.kvcache_service.contract.hashing import extra_key_digest, page_hashes
from kvserve.kvcache_service.core import ManagerConfig
from tests.kvcache.conftest import ServerThread
from tests.service.conftest import ModelServerThread
from tests.service.util import generate, greedy, request, rpc_error, wait_until

PROMPT = list(range(10, 31))   # 21 tokens: 5 full pages of 4


@pytest.fixture
def worker(tiny_dirs):
    manager = ServerThread("127.0.0.1:0", ManagerConfig(num_pages=512, page_size=4, max_seqs=64))
    model = None
    try:
        model = ModelServerThread(tiny_dirs["tiny"], kvcache=manager.address, cache_salt="deploy-a")
        yield manager, model
    finally:
        if model is not None:
            model.stop()
        if manager.thread.is_alive():   # the test may have stopped it
            manager.stop()


def test_the_worker_relays_its_managers_events_with_the_epoch(worker):
    manager, model = worker
    with grpc.insecure_channel(model.address) as ch:
        events = kv_pb_grpc.KVCacheEventsStub(ch).WatchEvents(kv_pb.WatchEventsRequest(snapshot=True), timeout=30)
        snapshot = next(events)
        epoch = manager.manager.epoch
        assert snapshot.HasField("snapshot") and snapshot.epoch == epoch > 0
        info = pb_grpc.InferenceStub(ch).GetModelInfo(pb.GetModelInfoRequest(), timeout=10)
        assert info.extra_key_digest == extra_key_digest("deploy-a") != extra_key_digest("")
        generate(pb_grpc.InferenceStub(ch), request(token_ids=PROMPT, **greedy(3)))
        stored = next(events)
        assert stored.epoch == epoch and stored.number == snapshot.number + 1
        # the worker's hashes, salted with its --cache-salt
        assert list(stored.stored.hashes) == page_hashes(PROMPT, 4, extra_key="deploy-a")[:len(stored.stored.hashes)]
        manager.stop()
        with pytest.raises(grpc.RpcError) as ended:
            for _ in events:
                pass
        assert ended.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "subscribe again" in ended.value.details()
        # Asked while the manager is down: grpc's reason names its address, the log's, not a client's.
        err = rpc_error(lambda: next(kv_pb_grpc.KVCacheEventsStub(ch).WatchEvents(
            kv_pb.WatchEventsRequest(snapshot=True), timeout=30)))
        assert err.code() == grpc.StatusCode.UNAVAILABLE and "subscribe again" in err.details()
        assert manager.address.rsplit(":", 1)[1] not in err.details(), err.details()


def test_a_worker_with_an_in_process_manager_has_no_events_to_relay(model_server):
    with grpc.insecure_channel(model_server.address) as ch:
        stub = kv_pb_grpc.KVCacheEventsStub(ch)
        err = rpc_error(lambda: stub.WatchEvents(kv_pb.WatchEventsRequest(snapshot=True), timeout=10))
        assert err.code() == grpc.StatusCode.FAILED_PRECONDITION and "in-process" in err.details()


def test_a_drain_ends_the_relayed_stream_unavailable_without_an_error_logged(worker, caplog):
    """The server's stop would cancel a stream still open at its end, and grpc logs each such
    cancel as an unhandled exception at ERROR."""
    import asyncio

    from kvserve.model_service.server import drain

    manager, model = worker
    with grpc.insecure_channel(model.address) as ch:
        events = kv_pb_grpc.KVCacheEventsStub(ch).WatchEvents(kv_pb.WatchEventsRequest(snapshot=True), timeout=60)
        next(events)   # the snapshot: the stream is open
        asyncio.run_coroutine_threadsafe(drain(model.running, model.servicer, 1.0), model.loop).result(30)
        err = rpc_error(lambda: list(events))
    assert err.code() == grpc.StatusCode.UNAVAILABLE
    assert err.details() == "this worker is shutting down: its event stream ends here"
    assert not [r for r in caplog.records if r.levelname == "ERROR"], [r.getMessage() for r in caplog.records]


def test_event_streams_past_the_limit_are_refused_resource_exhausted(worker):
    """Each relayed stream is one at the manager, and every event goes to each: a client that
    opens them by the hundred and never reads them is refused past MAX_STREAMS."""
    manager, model = worker
    model.servicer.cache_events.max_streams = 1
    with grpc.insecure_channel(model.address) as ch:
        stub = kv_pb_grpc.KVCacheEventsStub(ch)
        first = stub.WatchEvents(kv_pb.WatchEventsRequest(snapshot=True), timeout=60)
        next(first)
        err = rpc_error(lambda: next(stub.WatchEvents(kv_pb.WatchEventsRequest(snapshot=True), timeout=60)))
        assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "already relays 1 event streams" in err.details()
        first.cancel()
        wait_until(lambda: not model.servicer.cache_events._calls, what="the first stream's end")
        again = stub.WatchEvents(kv_pb.WatchEventsRequest(snapshot=True), timeout=60)
        assert next(again) is not None
        again.cancel()


def test_snapshots_past_an_addresss_burst_wait_and_its_streams_are_bounded(worker, monkeypatch):
    """A snapshot walks the manager's whole tree on the loop its Steps wait on: one address may
    ask a few at once, then one every SNAPSHOT_REFILL_S (RESOURCE_EXHAUSTED with retry-after-ms
    meanwhile); streams without one are not counted, and one address holds at most
    MAX_STREAMS_PER_ADDRESS."""
    from kvserve.model_service import cache_events

    manager, model = worker
    monkeypatch.setattr(cache_events, "SNAPSHOT_REFILL_S", 3600.0)
    with grpc.insecure_channel(model.address) as ch:
        stub = kv_pb_grpc.KVCacheEventsStub(ch)
        for _ in range(cache_events.SNAPSHOT_BURST):
            opened = stub.WatchEvents(kv_pb.WatchEventsRequest(snapshot=True), timeout=60)
            assert next(opened).HasField("snapshot")
            opened.cancel()
        refused = stub.WatchEvents(kv_pb.WatchEventsRequest(snapshot=True), timeout=60)
        err = rpc_error(lambda: next(refused))
        assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "snapshots were asked" in err.details()
        assert int(dict(err.trailing_metadata())["retry-after-ms"]) > 0
        wait_until(lambda: not model.servicer.cache_events._calls, what="the snapshot streams' end")
        held = [stub.WatchEvents(kv_pb.WatchEventsRequest(), timeout=60)
                for _ in range(cache_events.MAX_STREAMS_PER_ADDRESS)]
        wait_until(lambda: len(model.servicer.cache_events._calls) == len(held), what="the streams open")
        err = rpc_error(lambda: next(stub.WatchEvents(kv_pb.WatchEventsRequest(), timeout=60)))
        assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "from this client's address" in err.details()
        for call in held:
            call.cancel()


class WedgedManager(kv_pb_grpc.KVCacheManagerServicer):
    """Takes WatchEvents and never sends its snapshot."""

    async def WatchEvents(self, request, context):
        await asyncio.sleep(3600)
        yield kv_pb.Event()


def test_a_manager_that_sends_no_snapshot_holds_the_relays_place_for_a_while_only(monkeypatch):
    """Snapshots go upstream one at a time: a wedged manager held that place for ever, and every
    other gateway's snapshot on the worker waited behind it in silence."""
    from kvserve.model_service import cache_events
    from kvserve.model_service.cache_events import CacheEventsServicer
    from tests.server_thread import LoopThread

    monkeypatch.setattr(cache_events, "SNAPSHOT_WAIT_S", 0.5)
    loop = LoopThread("wedged manager")
    try:
        async def start():
            manager, relay = grpc.aio.server(), grpc.aio.server()
            kv_pb_grpc.add_KVCacheManagerServicer_to_server(WedgedManager(), manager)
            port = manager.add_insecure_port("127.0.0.1:0")
            await manager.start()
            kv_pb_grpc.add_KVCacheEventsServicer_to_server(CacheEventsServicer(f"127.0.0.1:{port}"), relay)
            relay_port = relay.add_insecure_port("127.0.0.1:0")
            await relay.start()
            return manager, relay, relay_port
        manager, relay, port = loop.call(start())
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            stub = kv_pb_grpc.KVCacheEventsStub(ch)
            for _ in range(2):   # the second finds the place free again
                err = rpc_error(lambda: next(stub.WatchEvents(kv_pb.WatchEventsRequest(snapshot=True), timeout=30)))
                assert err.code() == grpc.StatusCode.UNAVAILABLE and "sent no snapshot in 0.5 s" in err.details()
        loop.call(relay.stop(None))
        loop.call(manager.stop(None))
    finally:
        loop.close()
