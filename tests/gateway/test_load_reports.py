"""How the gateway learns each worker's load and health: pushed by the worker (WatchServerStats),
nothing polled; polled from a worker without it; a worker whose stream goes silent is down; and
the gateway's own WatchServerStats over its fleet."""

from __future__ import annotations

import asyncio
import time

import grpc

from kvserve.inference.v1 import inference_pb2 as pb
from kvserve.inference.v1 import inference_pb2_grpc as pb_grpc
from kvserve.kvcache.v1 import kvcache_pb2 as kv_pb
from kvserve.kvcache_service.contract.hashing import extra_key_digest
from kvserve.model_service.servicer import InferenceServicer
from tests.gateway.conftest import GatewayThread, make_fleet
from tests.server_thread import LoopThread
from tests.service.util import Stream, generate, greedy, request, wait_until

PROMPT = [11, 12, 13, 14, 15, 16, 17, 18, 19]


def count_polls(monkeypatch) -> list[int]:
    """Counts the GetServerStats calls every worker answers from now on."""
    polls = [0]
    answer = InferenceServicer.GetServerStats

    async def counted(self, request, context):
        polls[0] += 1
        return await answer(self, request, context)

    monkeypatch.setattr(InferenceServicer, "GetServerStats", counted)
    return polls


def busy_worker(fleet):
    return next((w for w in fleet.gateway.fleet.workers.values() if w.load.running), None)


def test_workers_push_their_load_and_are_never_polled(tiny_dirs, monkeypatch):
    polls = count_polls(monkeypatch)
    for fleet in make_fleet(tiny_dirs["tiny"], 2):
        call = fleet.stub.Generate(request(token_ids=PROMPT, **greedy(1500)), timeout=120)
        wait_until(lambda: busy_worker(fleet) is not None, what="a worker's report of the running request")
        call.cancel()
        wait_until(lambda: busy_worker(fleet) is None, what="the report that it ended")
        assert len(generate(fleet.stub, request(token_ids=PROMPT, **greedy(3))).tokens) == 3
        assert polls[0] == 0


def test_a_worker_without_the_stream_is_polled(tiny_dirs, monkeypatch, caplog):
    async def unimplemented(self, request, context):
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "Method not implemented!")
        yield

    monkeypatch.setattr(InferenceServicer, "WatchServerStats", unimplemented)
    polls = count_polls(monkeypatch)
    caplog.set_level("INFO", logger="kvserve.services.gateway.follow")
    for fleet in make_fleet(tiny_dirs["tiny"], 2):   # serving (health read by polls) and following events
        call = fleet.stub.Generate(request(token_ids=PROMPT, **greedy(1500)), timeout=120)
        wait_until(lambda: busy_worker(fleet) is not None, what="a polled report of the running request")
        call.cancel()
        assert polls[0] > 0
        assert "does not push its load (no WatchServerStats); polling it every 0.05 s" in caplog.text


def test_a_worker_whose_streams_are_full_is_polled_not_taken_for_failed(tiny_dirs, monkeypatch, caplog):
    """A worker keeps at most 64 WatchServerStats streams: the gateway that asks for one more
    took the RESOURCE_EXHAUSTED for a failure, marked the worker down and moved its streams."""
    async def full(self, request, context):
        await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "64 WatchServerStats streams are open")
        yield

    monkeypatch.setattr(InferenceServicer, "WatchServerStats", full)
    polls = count_polls(monkeypatch)
    for fleet in make_fleet(tiny_dirs["tiny"], 1):   # serving: make_fleet waits for it
        out = generate(fleet.stub, request(token_ids=PROMPT, **greedy(3)))
        assert len(out.tokens) == 3 and polls[0] > 0
        assert [w.state for w in fleet.gateway.fleet.workers.values()] == ["serving"]
        assert "keeps no more WatchServerStats streams" in caplog.text and "is down" not in caplog.text


def test_a_polled_worker_that_drains_keeps_its_streams(tiny_dirs, monkeypatch, caplog):
    """A draining worker closes its port at once (GOAWAY): the next poll is refused. The gateway
    took that for a failure, marked the worker down and moved its streams off, redoing their
    prefill elsewhere (here, with no other worker, failing them)."""
    from kvserve.model_service.server import drain

    async def full(self, request, context):
        await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "64 WatchServerStats streams are open")
        yield

    monkeypatch.setattr(InferenceServicer, "WatchServerStats", full)
    caplog.set_level("INFO", logger="kvserve.services.gateway.follow")
    for fleet in make_fleet(tiny_dirs["tiny"], 1):
        call = fleet.stub.Generate(request(token_ids=PROMPT, **greedy(1500)), timeout=120)
        wait_until(lambda: busy_worker(fleet) is not None, what="a polled report of the running request")
        [worker] = fleet.workers
        server = worker.model
        draining = asyncio.run_coroutine_threadsafe(drain(server.running, server.servicer, 60.0), server.loop)
        [w] = fleet.gateway.fleet.workers.values()
        wait_until(lambda: "refuses new connections" in w.not_serving, what="a poll refused by the drained port")
        assert w.state == "not serving"
        assert w.not_serving == "it refuses new connections (draining, or stopped)"   # no address: clients read it
        assert worker_address_of(w) not in fleet.gateway.fleet.why_none_serving(addresses=False)
        out = Stream(events=list(call))
        assert len(out.tokens) == 1500 and out.finished is not None
        draining.result(timeout=60)
        wait_until(lambda: w.state == "down", what="the worker down once its port is closed and its streams ended")
        assert caplog.text.index("refuses new connections") < caplog.text.index("is down")


def test_only_a_refused_connection_under_running_streams_spares_a_polled_worker():
    """A host that refuses the connection is up: a draining worker's, or a dead process's whose
    streams' connections are reset too. An unreachable host (a lost machine) or a timeout (a
    hung worker) resets nothing: that worker is down and its streams move."""
    from types import SimpleNamespace

    from kvserve.services.gateway.follow import Follower

    def error(code, details):
        return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details)

    follower = Follower.__new__(Follower)
    follower.worker = SimpleNamespace(relays={object()})
    refused = ("failed to connect to all addresses; last error: UNKNOWN: ipv4:10.0.0.7:50051: "
               "Failed to connect to remote host: Connection refused")
    assert follower._refused_under_streams(error(grpc.StatusCode.UNAVAILABLE, refused))
    assert not follower._refused_under_streams(error(grpc.StatusCode.UNAVAILABLE, refused.replace(
        "Connection refused", "No route to host")))
    assert not follower._refused_under_streams(error(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded"))
    follower.worker.relays = set()
    assert not follower._refused_under_streams(error(grpc.StatusCode.UNAVAILABLE, refused))


def test_a_refusing_worker_whose_streams_fall_silent_is_down(monkeypatch):
    """A drain that hangs (its loop wedged, the process stopped) keeps refusing connections while
    its streams say nothing: after REFUSED_SILENCE_S without an event it is down and they move."""
    from kvserve.services.gateway import follow
    from kvserve.services.gateway.worker import Worker

    monkeypatch.setattr(follow, "REFUSED_SILENCE_S", 0.2)
    moved: list[Worker] = []
    worker = Worker("10.0.0.7:50051", channel=None, state="serving")
    worker.relays.add(object())
    follower = follow.Follower(worker, index=None, cache_salt="", poll_s=0.05, on_change=lambda: None,
                               on_down=moved.append)
    refused = grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(),
                                   "failed to connect to all addresses; last error: Connection refused")
    follower._refusing(refused)
    assert worker.state == "not serving" and not moved
    for _ in range(3):   # its streams still speak: it drains
        time.sleep(0.1)
        worker.events_heard += 1
        follower._refusing(refused)
    assert worker.state == "not serving" and not moved
    time.sleep(0.3)   # silent past the bound
    follower._refusing(refused)
    assert worker.state == "down" and moved == [worker] and "said nothing for 0.2 s" in worker.not_serving


class HangingWorker(pb_grpc.InferenceServicer):
    """Answers GetModelInfo, sends one load report, then says nothing more: a hung worker
    whose connection stays up."""

    async def GetModelInfo(self, request, context):
        return pb.ModelInfo(page_size=4, max_num_seqs=4, extra_key_digest=extra_key_digest(""))

    async def WatchServerStats(self, request, context):
        yield pb.ServerStats(serving=True, running=2, waiting=1,
                             kvcache=kv_pb.Stats(free_pages=90, used_pages=10, total_pages=100))
        await asyncio.sleep(3600)


def test_a_worker_whose_stream_goes_silent_is_down(tiny_dirs, monkeypatch, caplog):
    from kvserve.services.gateway import follow

    monkeypatch.setattr(follow, "LOAD_SILENCE_S", 0.5)
    worker = LoopThread("hanging worker")
    gateway = None
    try:
        async def start():
            server = grpc.aio.server()
            pb_grpc.add_InferenceServicer_to_server(HangingWorker(), server)
            port = server.add_insecure_port("127.0.0.1:0")
            await server.start()
            return server, port
        server, port = worker.call(start())
        gateway = GatewayThread([f"127.0.0.1:{port}"], model=str(tiny_dirs["tiny"]))
        states = lambda: {w.state for w in gateway.fleet.workers.values()}  # noqa: E731
        wait_until(lambda: states() == {"serving"}, what="the worker's first report")
        wait_until(lambda: states() == {"down"}, what="the silent worker marked down")
        assert "its load stream sent nothing for 0.5 s" in caplog.text
        # what it said last is not what it holds now: the gateway's stats show no load there
        with grpc.insecure_channel(gateway.address) as ch:
            stats = pb_grpc.InferenceStub(ch).GetServerStats(pb.GetServerStatsRequest(), timeout=10)
        [w] = stats.workers
        assert (w.state, w.running, w.waiting, w.used_pages, w.free_pages) == ("down", 0, 0, 0, 0)
        assert (stats.running, stats.waiting) == (0, 0)
        worker.call(server.stop(None))
    finally:
        if gateway is not None:
            gateway.stop()
        worker.close()


class NonsenseWorker(HangingWorker):
    """Says its pages hold 0 tokens each: what no kvserve worker says (a bug, another server)."""

    async def GetModelInfo(self, request, context):
        return pb.ModelInfo(page_size=0, max_model_len=64, max_num_seqs=4, extra_key_digest=extra_key_digest(""))


def test_a_worker_reporting_a_page_size_of_0_is_routed_nothing(tiny_dirs):
    """The board's page size is its workers' smallest: one worker's 0 made every routing divide by
    zero, and every Generate through the gateway failed INTERNAL."""
    worker = LoopThread("nonsense worker")
    gateway = None
    try:
        async def start():
            server = grpc.aio.server()
            pb_grpc.add_InferenceServicer_to_server(NonsenseWorker(), server)
            port = server.add_insecure_port("127.0.0.1:0")
            await server.start()
            return server, port
        server, port = worker.call(start())
        gateway = GatewayThread([f"127.0.0.1:{port}"], model=str(tiny_dirs["tiny"]), no_worker_timeout_s=0.5)
        [w] = gateway.fleet.workers.values()
        wait_until(lambda: "page size of 0" in w.not_serving, what="the worker refused a place")
        assert gateway.fleet.page_size is None   # nothing on the board
        with grpc.insecure_channel(gateway.address) as ch:
            try:
                generate(pb_grpc.InferenceStub(ch), request(token_ids=[5, 6, 7], **greedy(2)))
                raise AssertionError("served by a worker that reports nonsense")
            except grpc.RpcError as err:
                assert err.code() == grpc.StatusCode.UNAVAILABLE, (err.code(), err.details())
        worker.call(server.stop(None))
    finally:
        if gateway is not None:
            gateway.stop()
        worker.close()


def test_the_gateway_streams_its_fleets_stats(two_workers):
    fleet = two_workers
    reports = fleet.stub.WatchServerStats(pb.WatchServerStatsRequest(interval_ms=10), timeout=60)
    first = next(reports)
    assert first.serving and len(first.workers) == 2 and {w.state for w in first.workers} == {"serving"}
    call = fleet.stub.Generate(request(token_ids=PROMPT, **greedy(1500)), timeout=120)
    assert next(r for r in reports if r.running == 1).serving
    call.cancel()
    assert next(r for r in reports if r.running == 0).running == 0
    reports.cancel()


def test_a_workers_report_carries_the_prefill_ahead_and_the_gateway_shows_it(tiny_dirs):
    """A long prompt in chunks of 4 tokens a step: the worker's reports say how much of it is left
    (ServerStats.prefill_tokens), the gateway's stats show it per worker, and it falls to 0."""
    for fleet in make_fleet(tiny_dirs["tiny"], 1, worker_config={"max_num_batched_tokens": 4}):
        [w] = fleet.gateway.fleet.workers.values()
        seen = []
        call = fleet.stub.Generate(request(token_ids=[3 + i % 1000 for i in range(1600)], **greedy(2)), timeout=120)
        wait_until(lambda: seen.append(w.load.prefill_tokens) or seen[-1] > 0,
                   what="a report of the prompt's prefill under way")
        assert 0 < seen[-1] <= 1600
        assert 0 < w.prefill_backlog <= 1600
        assert len(list(call)) >= 3   # prefill_done, tokens, finished
        wait_until(lambda: w.load.prefill_tokens == 0 and w.prefill_backlog == 0,
                   what="a report of no prefill left")
        stats = fleet.stub.GetServerStats(pb.GetServerStatsRequest(), timeout=10)
        assert stats.prefill_tokens == 0 and stats.workers[0].prefill_tokens == 0


def worker_address_of(w) -> str:
    """The host:port grpc's own error details name (the worker's address without its scheme)."""
    return w.address.split("://")[-1]


def test_the_gateways_stats_stream_moves_with_each_workers_load_in_steps(monkeypatch):
    """A worker's report carries exact page counts, one at least every heartbeat: keyed on them,
    the gateway's every stats stream rebuilt the whole fleet's stats at almost every look. Its
    pages count in the worker's own steps (1/64 of its cache), and one look serves every stream
    looking within MIN_INTERVAL_MS."""
    from kvserve.services.gateway.fleet import Fleet
    from kvserve.services.gateway.servicer import GatewayServicer
    from kvserve.services.gateway.waiting import WaitQueue
    from kvserve.services.gateway.worker import SERVING, Load, Worker

    fleet = Fleet("", 1.0, 2, 0.05, WaitQueue(100))
    for i in range(3):
        w = Worker(f"10.0.0.{i}:50051", None)
        w.set_info(pb.ModelInfo(page_size=16, max_model_len=4096, num_pages=8192, max_num_seqs=64))
        w.state = SERVING
        w.loaded(Load(running=3, free_pages=4000, asked_at=0))
        fleet.workers[w.address] = w
    from kvserve.services.gateway import servicer as servicer_module

    now = [100.0]
    monkeypatch.setattr(servicer_module.time, "monotonic", lambda: now[0])
    servicer = GatewayServicer(fleet, None, 3)
    first = servicer._load()
    w.loaded(Load(running=3, free_pages=3999, asked_at=0))   # a page taken by a decode
    now[0] += 0.005
    assert servicer._load() is first                          # looked at within the interval: the same key
    servicer._load_key = None
    assert servicer._load() == first                          # within the worker's step: no message
    w.loaded(Load(running=3, free_pages=4000 - 8192 // 64, asked_at=0))
    servicer._load_key = None
    assert servicer._load() != first


def test_the_fleets_totals_count_the_workers_it_routes_to_as_their_rows_say():
    """The totals summed every worker, those serving another model too, and the prefill ahead
    as the workers reported it while each row showed the gateway's own backlog."""
    from kvserve.services.gateway.fleet import Fleet
    from kvserve.services.gateway.servicer import GatewayServicer
    from kvserve.services.gateway.waiting import WaitQueue
    from kvserve.services.gateway.worker import SERVING, Load, Worker

    fleet = Fleet("", 1.0, 2, 0.05, WaitQueue(100))
    for i, excluded in enumerate((False, True)):
        w = Worker(f"10.0.0.{i}:50051", None)
        w.set_info(pb.ModelInfo(page_size=16, max_model_len=4096, num_pages=8192, max_num_seqs=64))
        w.state, w.excluded = SERVING, excluded
        w.loaded(Load(running=3, waiting=2, free_pages=4000, asked_at=0, prefill_tokens=100))
        fleet.workers[w.address] = w
    stats = GatewayServicer(fleet, None, 3)._stats()
    assert (stats.running, stats.waiting) == (3, 2)
    assert stats.prefill_tokens == stats.workers[0].prefill_tokens
