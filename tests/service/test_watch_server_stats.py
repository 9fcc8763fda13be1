"""WatchServerStats on the model service, over a real socket: a report at once, one whenever
the load changes (a request arriving counts the moment Generate hands it over, before the
engine's next step), heartbeats while nothing changes, a clear INVALID_ARGUMENT for periods
out of range, and an orderly end when the server drains."""

from __future__ import annotations

import asyncio
import queue
import threading

import grpc
import pytest

from kvserve.inference.v1 import inference_pb2 as pb
from kvserve.inference.v1 import inference_pb2_grpc as pb_grpc
from tests.service.util import greedy, request, rpc_error, wait_until

PROMPT = [17, 4, 250, 999, 31, 8, 77]


class Watch:
    """A WatchServerStats call read on a thread: its reports in a queue, its end status."""

    def __init__(self, stub, **periods) -> None:
        self.reports: queue.Queue = queue.Queue()
        self.code = None
        self.call = stub.WatchServerStats(pb.WatchServerStatsRequest(**periods), timeout=120)
        self.ended = threading.Event()
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        try:
            for stats in self.call:
                self.reports.put(stats)
            self.code = grpc.StatusCode.OK
        except grpc.RpcError as exc:
            self.code = exc.code()
        self.ended.set()

    def next_where(self, check, timeout: float = 30) -> pb.ServerStats:
        seen = []
        while True:
            try:
                stats = self.reports.get(timeout=timeout)
            except queue.Empty:
                raise AssertionError(f"no such report in {timeout} s; seen (running, waiting): "
                                     f"{[(s.running, s.waiting) for s in seen]}, the stream {self.code}") from None
            if check(stats):
                return stats
            seen.append(stats)


def test_a_report_at_once_then_one_per_change_of_load(small_server):
    with grpc.insecure_channel(small_server.address) as ch:
        stub = pb_grpc.InferenceStub(ch)
        watch = Watch(stub, interval_ms=10)
        first = watch.reports.get(timeout=10)
        assert first.serving and first.not_serving == ""
        assert (first.running, first.waiting) == (0, 0)
        assert first.kvcache.total_pages == 512 and first.manager_reachable
        # one sequence runs at a time (max_num_seqs 1) and one may wait (max_waiting 1): the second
        # is sent once the first runs, and is reported waiting
        long_calls = [stub.Generate(request(token_ids=PROMPT, **greedy(1500)), timeout=120)]
        watch.next_where(lambda s: (s.running, s.waiting) == (1, 0))
        long_calls.append(stub.Generate(request(token_ids=PROMPT + [1], **greedy(1500)), timeout=120))
        busy = watch.next_where(lambda s: (s.running, s.waiting) == (1, 1))
        assert busy.serving
        for call in long_calls:
            call.cancel()
        watch.next_where(lambda s: (s.running, s.waiting) == (0, 0))
        watch.call.cancel()


def test_a_quiet_server_still_sends_heartbeats(model_server):
    with grpc.insecure_channel(model_server.address) as ch:
        watch = Watch(pb_grpc.InferenceStub(ch), interval_ms=10, heartbeat_ms=100)
        reports = [watch.reports.get(timeout=10) for _ in range(4)]   # nothing changed between them
        assert len({(r.running, r.waiting, r.kvcache.free_pages) for r in reports}) == 1
        watch.call.cancel()


@pytest.mark.parametrize("periods, words", [
    (dict(interval_ms=5), "interval_ms is 5; it must be 0 (for 50) or 10 to 60000"),
    (dict(interval_ms=100, heartbeat_ms=50), "heartbeat_ms is 50; it must be 0 (for 1000) or from interval_ms (100)"),
    (dict(interval_ms=10, heartbeat_ms=10), "heartbeat_ms is 10; it must be 0 (for 1000) or from interval_ms (10) "
                                            "and 100 up to 60000"),
    (dict(interval_ms=70_000), "interval_ms is 70000"),
])
def test_periods_out_of_range_are_invalid_argument(model_server, periods, words):
    with grpc.insecure_channel(model_server.address) as ch:
        err = rpc_error(lambda: list(pb_grpc.InferenceStub(ch).WatchServerStats(
            pb.WatchServerStatsRequest(**periods), timeout=10)))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert words in err.details()


def test_a_drain_is_reported_not_serving_and_the_stream_ends_once_the_last_call_returned(tiny_dirs, capsys):
    from kvserve.model_service.server import drain
    from kvserve.services.cli.main import main
    from tests.service.conftest import ModelServerThread

    server = ModelServerThread(tiny_dirs["tiny"])
    try:
        with grpc.insecure_channel(server.address) as ch:
            stub = pb_grpc.InferenceStub(ch)
            watch = Watch(stub, interval_ms=10)
            assert watch.reports.get(timeout=10).serving
            call = stub.Generate(request(token_ids=PROMPT, **greedy(1500)), timeout=120)   # runs past the checks
            wait_until(lambda: server.servicer.engine.num_live() == 1, what="the request running")
            draining = asyncio.run_coroutine_threadsafe(drain(server.running, server.servicer, 100.0), server.loop)
            told = watch.next_where(lambda s: not s.serving)   # a stream open before the drain says it
            assert told.not_serving == "the server is draining"
            # new calls are not taken (GOAWAY: a client's next call goes to another server)
            assert main(["stats", "--address", server.address]) != 0
            assert "UNAVAILABLE" in capsys.readouterr().err
            assert list(call)[-1].finished.finish_reason == pb.FINISH_REASON_LENGTH   # it still finishes
            assert watch.ended.wait(30)
            assert watch.code == grpc.StatusCode.OK
            draining.result(100)
    finally:
        server.stop()


def watches_up_to_a_refusal(stub, places: int) -> list[Watch]:
    """`places` streams, each reporting; the next one refused RESOURCE_EXHAUSTED."""
    watches = [Watch(stub, interval_ms=1000) for _ in range(places)]
    for w in watches:
        assert w.reports.get(timeout=10)
    extra = Watch(stub, interval_ms=1000)
    assert extra.ended.wait(10) and extra.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    return watches


def test_streams_past_the_cap_are_refused_and_a_closed_one_makes_room(model_server, monkeypatch):
    """Each stream looks at the load on the server's event loop: without a cap, hundreds of them
    slowed every other request there."""
    from kvserve.services.plumbing import stats_watch

    monkeypatch.setattr(stats_watch, "MAX_STREAMS", 3)
    with grpc.insecure_channel(model_server.address) as ch:
        stub = pb_grpc.InferenceStub(ch)
        watches = watches_up_to_a_refusal(stub, 3)
        watches[0].call.cancel()
        assert watches[0].ended.wait(10)
        wait_until(lambda: model_server.servicer._shared_stats.streams == 2, what="the closed stream counted out")
        again = Watch(stub, interval_ms=1000)
        assert again.reports.get(timeout=10)
        for w in watches[1:] + [again]:
            w.call.cancel()


def test_one_client_address_holds_a_few_of_the_places(model_server, monkeypatch):
    """One client opening every place locked out the gateways that follow the worker."""
    from kvserve.services.plumbing import stats_watch

    monkeypatch.setattr(stats_watch, "MAX_STREAMS_PER_ADDRESS", 2)
    with grpc.insecure_channel(model_server.address) as ch:
        stub = pb_grpc.InferenceStub(ch)
        watches = watches_up_to_a_refusal(stub, 2)
        assert model_server.servicer._shared_stats.by_address == {"ipv4:127.0.0.1": 2}
        for w in watches:
            w.call.cancel()
        wait_until(lambda: not model_server.servicer._shared_stats.by_address, what="the streams counted out")
    # an IPv6 host holds a /64: its addresses are one client; an IPv4-mapped one is its IPv4 host
    assert stats_watch.client_address("ipv6:[2001:db8::7]:41234") == \
        stats_watch.client_address("ipv6:%5B2001:db8::8:9%5D:5") == "ipv6:2001:db8::/64"
    assert stats_watch.client_address("ipv6:[::ffff:10.0.0.7]:41234") == "ipv4:10.0.0.7"
    assert stats_watch.client_address("unix:/run/w.sock") == "unix:/run/w.sock"


def test_streams_sending_at_the_same_load_share_one_build():
    """Several gateways follow one worker: a change costs it one build (a manager call), not one
    per stream; another load, or a build older than the shortest interval, is built anew."""
    from kvserve.services.plumbing.stats_watch import SharedStats

    builds = []

    async def build() -> pb.ServerStats:
        builds.append(1)
        return pb.ServerStats(running=len(builds))

    async def run():
        shared = SharedStats(build, load=lambda: None)
        first, second = await asyncio.gather(shared.get((1, 0)), shared.get((1, 0)))
        assert first is second and len(builds) == 1
        assert (await shared.get((2, 0))).running == 2
        await asyncio.sleep(0.05)
        assert (await shared.get((2, 0))).running == 3

    asyncio.run(run())


def test_pages_taken_one_by_one_by_a_decoding_batch_send_no_report_until_a_step_of_the_cache():
    from kvserve.services.plumbing.stats_watch import pages_key

    total = 6400                                   # steps of 100 pages; exact below 400
    assert len({pages_key(free, total) for free in range(5000, 5100)}) == 1
    assert pages_key(4999, total) != pages_key(5000, total)
    assert len({pages_key(free, total) for free in range(300, 400)}) == 100   # nearly full: every page
    assert len({pages_key(free, 20) for free in range(20)}) == 20             # a tiny cache: every page
