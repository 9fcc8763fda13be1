"""The gateway in front of two workers (each a model service with its own manager, over real
gRPC): routing by what each cache holds, the index kept equal to each manager's tree, hashes
computed as the workers compute them, the queue, Cancel."""

from __future__ import annotations

import asyncio
import threading
import time

import grpc
import pytest

from kvserve.inference.v1 import inference_pb2 as pb
from kvserve.kvcache.v1 import kvcache_pb2 as kv_pb
from kvserve.kvcache.v1 import kvcache_pb2_grpc as kv_pb_grpc
from kvserve.inference.v1 import inference_pb2_grpc as pb_grpc
from tests.gateway.conftest import GatewayThread, WorkerThreads, make_fleet
from tests.service.processes import free_port
from tests.service.util import generate, greedy, request, wait_until

SYSTEM = list(range(100, 164))   # 64 tokens: 16 pages


def routed(fleet) -> dict[str, int]:
    stats = fleet.stub.GetServerStats(pb.GetServerStatsRequest(), timeout=10)
    return {w.address: w.requests_routed for w in stats.workers}


def run_on(fleet, msg) -> tuple[str, object]:
    """Sends one request and says which worker the gateway sent it to."""
    before = routed(fleet)
    out = generate(fleet.stub, msg)
    after = routed(fleet)
    [worker] = [a for a in after if after[a] != before.get(a, 0)]
    return worker, out


def indexed(fleet, ids: list[int]) -> bool:
    """Every full page of `ids` is in the gateway's index for some worker."""
    f = fleet.gateway.fleet
    hashes = f.hashes(ids)
    return max(f.index.matches(hashes, list(f.workers)).values(), default=0) == len(hashes)


def tree_hashes(worker) -> set[int]:
    with grpc.insecure_channel(worker.manager.address) as ch:
        events = kv_pb_grpc.KVCacheManagerStub(ch).WatchEvents(kv_pb.WatchEventsRequest(snapshot=True), timeout=10)
        snapshot = next(events)
        events.cancel()
    return set(snapshot.snapshot.hashes)


def test_a_conversation_stays_on_the_worker_that_holds_it(two_workers):
    fleet = two_workers
    conversations = {c: [200 + c] * 6 + SYSTEM[:8] for c in range(4)}   # nothing shared: they spread
    used: dict[int, set[str]] = {c: set() for c in conversations}
    for turn in range(3):
        for c, history in conversations.items():
            worker, out = run_on(fleet, request(token_ids=history, **greedy(6)))
            used[c].add(worker)
            if turn:
                # all of the history the worker had stored: its full pages but the last prompt token's
                assert out.prefill.cached_tokens >= (len(history) - 1) // 4 * 4 - 4, (turn, out.prefill)
            conversations[c] = history + out.tokens + [300 + turn, 301 + turn]
            wait_until(lambda: indexed(fleet, history), what="the turn's pages in the gateway's index")
    assert all(len(workers) == 1 for workers in used.values()), used
    assert len(set().union(*used.values())) == 2   # the four conversations are spread over both


def test_a_warm_system_prompt_draws_new_requests_to_its_worker(two_workers):
    fleet = two_workers
    warm, _ = run_on(fleet, request(token_ids=SYSTEM + [1, 2, 3], **greedy(2)))
    wait_until(lambda: indexed(fleet, SYSTEM), what="the system prompt in the gateway's index")
    for i in range(4):
        worker, out = run_on(fleet, request(token_ids=SYSTEM + [400 + i] * 5, **greedy(2)))
        assert worker == warm and out.prefill.cached_tokens == len(SYSTEM)


def test_a_long_prompt_is_hashed_off_the_event_loop_and_routed_alike(two_workers, monkeypatch):
    from kvserve.services.gateway import relay
    fleet = two_workers
    monkeypatch.setattr(relay, "HASH_OFF_LOOP_TOKENS", len(SYSTEM))   # every prompt here counts as long
    f = fleet.gateway.fleet
    on_loop: list[bool] = []   # for each hashing, whether it ran on an event loop's thread
    hashes = f.hashes

    def noted(*args, **kwargs):
        try:
            asyncio.get_running_loop()
            on_loop.append(True)
        except RuntimeError:
            on_loop.append(False)
        return hashes(*args, **kwargs)
    monkeypatch.setattr(f, "hashes", noted)
    warm, _ = run_on(fleet, request(token_ids=SYSTEM + [1, 2, 3], **greedy(2)))
    wait_until(lambda: indexed(fleet, SYSTEM), what="the system prompt in the gateway's index")
    on_loop.clear()
    worker, out = run_on(fleet, request(token_ids=SYSTEM + [500] * 5, **greedy(2)))
    assert worker == warm and out.prefill.cached_tokens == len(SYSTEM)
    assert on_loop == [False]


def test_the_index_equals_each_managers_tree_through_evictions(tiny_dirs):
    # 48 pages per worker: the workload below evicts, and the index must follow.
    for fleet in make_fleet(tiny_dirs["tiny"], 2, worker_config=dict(num_pages=48)):
        for i in range(24):
            generate(fleet.stub, request(token_ids=[(i * 37 + j) % 1000 + 3 for j in range(40)], **greedy(4)))
        index = fleet.gateway.fleet.index
        for w in fleet.workers:
            wait_until(lambda: {h for h in tree_hashes(w) if index.holds(w.address, h)} == tree_hashes(w)
                       and index.pages_of(w.address) == len(tree_hashes(w)), what="the index to equal the tree")
        stats = fleet.stub.GetServerStats(pb.GetServerStatsRequest(), timeout=10)
        evicted = [w for w in fleet.workers if w.manager.manager.stats().evictions]
        assert evicted, "the workload was meant to evict"
        assert sum(w.index_pages for w in stats.workers) == sum(len(tree_hashes(w)) for w in fleet.workers)


def test_a_managers_restart_drops_its_workers_old_pages(two_workers):
    from tests.kvcache.conftest import ServerThread

    fleet = two_workers
    worker, _ = run_on(fleet, request(token_ids=SYSTEM, **greedy(2)))
    w = fleet.worker_at(worker)
    gw_worker = fleet.gateway.fleet.workers[worker]
    wait_until(lambda: fleet.gateway.fleet.index.pages_of(worker) > 0, what="its pages in the index")
    old_epoch, address, config = gw_worker.epoch, w.manager.address, w.manager.manager.config
    w.manager.stop()
    wait_until(lambda: fleet.gateway.fleet.index.pages_of(worker) == 0, what="its pages dropped")
    w.manager = ServerThread(address, config)   # the same address, empty: the worker registers a new epoch
    wait_until(lambda: gw_worker.events_live and gw_worker.epoch != old_epoch, timeout=30,
               what="the new epoch's event stream")
    assert fleet.gateway.fleet.index.pages_of(worker) == 0
    out = generate(fleet.stub, request(token_ids=SYSTEM, **greedy(2)))
    assert len(out.tokens) == 2


@pytest.mark.parametrize("salt", ["tenant-a", "tenant-b"])
def test_the_gateway_hashes_prompts_as_the_workers_store_them(tiny_dirs, salt):
    for fleet in make_fleet(tiny_dirs["tiny"], 1, worker_config=dict(cache_salt=salt), cache_salt=salt):
        gw = fleet.gateway.fleet
        assert gw.workers[fleet.workers[0].address].hashes_match
        inputs = fleet.gateway.gateway.servicer.inputs
        prompt = request(prompt="the model token cache page batch memory server stream " * 3, **greedy(1))
        chat = request(messages=[("system", "be brief"), ("user", "the cache, the page, the batch " * 2)],
                       **greedy(1))
        ids = request(token_ids=list(range(50, 90)), **greedy(1))
        turns = [("user", "the cache, the page, the batch " * 2), ("assistant", "the page, the memory")]
        continued = request(messages=turns, **greedy(1))   # the chat template's options, rendered alike
        continued.messages.continue_final_message = True
        continued.messages.template_kwargs = '{"enable_thinking": false}'
        closed = request(messages=turns, **greedy(1))
        closed.messages.add_generation_prompt = False
        assert fleet.gateway.call(inputs.ids(continued)) != fleet.gateway.call(inputs.ids(closed))
        for msg in (prompt, chat, ids, continued, closed):
            generate(fleet.stub, msg)
            hashes = gw.hashes(fleet.gateway.call(inputs.ids(msg)))
            assert hashes and set(hashes) <= tree_hashes(fleet.workers[0]), msg.WhichOneof("input")
        # a request's own cache_salt, after the deployment's: its pages, and only they, hash with it
        salted = request(token_ids=list(range(200, 240)), **greedy(1))
        salted.cache_salt = "one user's"
        generate(fleet.stub, salted)
        ids = list(salted.token_ids.ids)
        assert set(gw.hashes(ids, cache_salt="one user's")) <= tree_hashes(fleet.workers[0])
        assert not set(gw.hashes(ids)) & tree_hashes(fleet.workers[0])


def test_a_worker_with_another_salt_is_routed_by_load_only(tiny_dirs):
    for fleet in make_fleet(tiny_dirs["tiny"], 1, worker_config=dict(cache_salt="theirs"), cache_salt="ours"):
        assert not fleet.gateway.fleet.workers[fleet.workers[0].address].hashes_match
        out = generate(fleet.stub, request(token_ids=SYSTEM, **greedy(3)))
        assert len(out.tokens) == 3


# ------------------------------------------------------------------- the queue


class Streamed:
    def __init__(self, stub, msg) -> None:
        self.events: list[pb.GenerateResponse] = []
        self.done = threading.Event()
        self.code = None
        self.call = stub.Generate(msg, timeout=120)
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        try:
            for e in self.call:
                self.events.append(e)
            self.code = grpc.StatusCode.OK
        except grpc.RpcError as exc:
            self.code = exc.code()
        self.done.set()

    @property
    def positions(self) -> list[int]:
        return [e.queued.position for e in self.events if e.HasField("queued")]

    def started(self) -> bool:
        return any(e.HasField("prefill_done") for e in self.events)


def test_with_every_worker_full_requests_wait_in_order_and_see_their_place(tiny_dirs):
    for fleet in make_fleet(tiny_dirs["tiny"], 2, worker_config=dict(max_num_seqs=1), worker_queue_depth=1):
        busy = []
        for i in range(4):   # two run, one waits at each worker
            busy.append(Streamed(fleet.stub, request(token_ids=[7 + i] * 9, **greedy(300))))
            wait_until(lambda: sum(routed(fleet).values()) == i + 1, what="the request routed")
        queued = []
        for i in range(3):
            queued.append(Streamed(fleet.stub, request(token_ids=[50 + i] * 9, **greedy(4))))
            wait_until(lambda: queued[-1].positions, what="a queued event")
        assert [q.positions[0] for q in queued] == [1, 2, 3]
        for s in busy + queued:
            assert s.done.wait(120)
            assert s.code == grpc.StatusCode.OK
        # each saw its place fall to the head, and they started in the order they came (two that
        # leave before a waiter's task runs again move it two places in one event)
        for i, q in enumerate(queued):
            p = q.positions
            if p[-1] == 0:   # it waited in its worker's queue too, told as the worker tells it
                p = p[:p.index(1) + 1]   # (the gateway's places end where it reached the head)
            assert p[0] == i + 1 and p[-1] == 1 and all(a > b for a, b in zip(p, p[1:])), p
        assert fleet.stub.GetServerStats(pb.GetServerStatsRequest(), timeout=10).queued == 0
        assert all(w.prefilling == 0 for w in fleet.gateway.fleet.workers.values())


def test_cancel_through_the_gateway_ends_the_stream_and_frees_the_workers_pages(two_workers):
    fleet = two_workers
    s = Streamed(fleet.stub, request(request_id="to-cancel", token_ids=SYSTEM, **greedy(1500)))
    wait_until(lambda: any(e.HasField("chunk") for e in s.events), what="the first tokens")
    fleet.stub.Cancel(pb.CancelRequest(request_id="to-cancel"), timeout=10)
    assert s.done.wait(30)
    assert s.events[-1].finished.finish_reason == pb.FINISH_REASON_ABORT
    for w in fleet.workers:
        wait_until(lambda: w.manager.manager.stats().used_pages == 0, what="the worker's pages freed")
    err = None
    try:
        fleet.stub.Cancel(pb.CancelRequest(request_id="to-cancel"), timeout=10)
    except grpc.RpcError as exc:
        err = exc
    assert err is not None and err.code() == grpc.StatusCode.NOT_FOUND
    stats = fleet.stub.GetServerStats(pb.GetServerStatsRequest(), timeout=10)
    assert (stats.requests_finished, stats.requests_aborted, stats.requests_failed) == (0, 1, 0)
    assert all(w.prefilling == 0 for w in fleet.gateway.fleet.workers.values())


def test_a_dropped_client_frees_the_workers_pages(two_workers):
    fleet = two_workers
    with grpc.insecure_channel(fleet.gateway.address) as ch:
        from kvserve.inference.v1 import inference_pb2_grpc as pb_grpc

        call = pb_grpc.InferenceStub(ch).Generate(request(token_ids=SYSTEM, **greedy(1500)), timeout=60)
        for e in call:
            if e.HasField("chunk"):
                break
        call.cancel()
    deadline = time.monotonic() + 10
    for w in fleet.workers:
        wait_until(lambda: w.manager.manager.stats().used_pages == 0, timeout=max(0.1, deadline - time.monotonic()),
                   what="the worker's pages freed")
    wait_until(lambda: fleet.stub.GetServerStats(pb.GetServerStatsRequest(), timeout=10).requests_aborted == 1,
               what="the stream counted as aborted")
    assert all(w.prefilling == 0 for w in fleet.gateway.fleet.workers.values())


def test_kvserve_stats_shows_the_gateways_workers(two_workers, capsys):
    from kvserve.clients.inference_client import InferenceClient
    from kvserve.services.cli.main import main

    fleet = two_workers
    generate(fleet.stub, request(token_ids=SYSTEM, **greedy(2)))
    with InferenceClient(fleet.gateway.address) as client:
        stats = client.server_stats()
    assert {w.address for w in stats.workers} == {w.address for w in fleet.workers}
    assert sum(w.requests_routed for w in stats.workers) == 1
    assert (stats.requests_finished, stats.requests_aborted, stats.requests_failed) == (1, 0, 0)
    assert stats.gateway   # a gateway says so (a model service leaves it false)
    assert main(["stats", "--address", fleet.gateway.address]) == 0
    out = capsys.readouterr().out
    assert all(w.address in out for w in fleet.workers) and "serving" in out and "epoch" in out
    assert all(w.lane == w_.model.servicer.lane.address for w in stats.workers
               for w_ in fleet.workers if w_.address == w.address)
    assert "lane" in out


def test_a_clients_deadline_ends_deadline_exceeded_through_the_lane_never_ok_cut_short(two_workers):
    """The lane's call meets the deadline when the client's call does: the gateway ended such a
    stream OK without its finished when grpc had not ended the call yet."""
    fleet = two_workers
    for timeout in (0.2, 0.5, 0.2, 0.5):
        with pytest.raises(grpc.RpcError) as info:
            list(fleet.stub.Generate(request(token_ids=SYSTEM, n=4, max_tokens=1000, ignore_eos=True,
                                             temperature=0.0), timeout=timeout))
        assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    for w in fleet.workers:
        wait_until(lambda: w.manager.manager.stats().used_pages == 0, what="the worker's pages freed")


def test_the_gateway_sends_requests_over_the_workers_lanes_and_over_grpc_with_lane_off(two_workers, tiny_dirs):
    """Both hops give the same tokens; --lane off leaves the workers' lanes unused."""
    from kvserve.inference.v1 import inference_pb2_grpc as pb_grpc
    from tests.gateway.conftest import GatewayThread

    fleet = two_workers
    msgs = [request(token_ids=SYSTEM + [7 + i], **greedy(6)) for i in range(4)]
    over_lanes = [generate(fleet.stub, m).tokens for m in msgs]
    lanes = [w.lane for w in fleet.gateway.fleet.workers.values()]
    assert all(lane is not None and lane.pings for lane in lanes)   # the workers read pings: theirs are pinged
    assert sum(lane.calls for lane in lanes) == 4 and sum(lane.fallbacks for lane in lanes) == 0
    off = GatewayThread([w.address for w in fleet.workers], model=str(tiny_dirs["tiny"]), lane="off")
    try:
        off.wait_serving(2)
        assert all(w.lane is None for w in off.fleet.workers.values())
        with grpc.insecure_channel(off.address) as ch:
            stub = pb_grpc.InferenceStub(ch)
            assert [generate(stub, m).tokens for m in msgs] == over_lanes
            stats = stub.GetServerStats(pb.GetServerStatsRequest(), timeout=10)
        assert all(w.lane == "" for w in stats.workers)
    finally:
        off.stop()


def test_with_no_worker_serving_a_request_waits_then_ends_unavailable(tiny_dirs):
    for fleet in make_fleet(tiny_dirs["tiny"], 1, no_worker_timeout_s=1.0):
        fleet.workers[0].model.stop()   # the only worker is gone
        wait_until(lambda: not fleet.gateway.fleet.serving(), what="the gateway to see it down")
        s = Streamed(fleet.stub, request(token_ids=SYSTEM, **greedy(2)))
        assert s.done.wait(30), "the request hung"
        assert s.code == grpc.StatusCode.UNAVAILABLE and s.positions == [1]
        stats = fleet.stub.GetServerStats(pb.GetServerStatsRequest(), timeout=10)
        assert (stats.requests_finished, stats.requests_aborted, stats.requests_failed) == (0, 0, 1)


def test_model_info_waits_for_a_worker_to_serve_as_a_request_does(tiny_dirs):
    """GetModelInfo (a client's first call, the HTTP front's) while no worker serves: answered
    once one does, and UNAVAILABLE, saying why, once --no-worker-timeout has passed."""
    address = f"127.0.0.1:{free_port()}"   # the worker's, before it listens
    gateway = GatewayThread([address], model=str(tiny_dirs["tiny"]), no_worker_timeout_s=60.0)
    worker = None
    try:
        with grpc.insecure_channel(gateway.address) as channel:
            stub = pb_grpc.InferenceStub(channel)
            with pytest.raises(grpc.RpcError) as waited:   # not refused at once: it waits
                stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=0.5)
            assert waited.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            answer = stub.GetModelInfo.future(pb.GetModelInfoRequest(), timeout=60)
            worker = WorkerThreads(tiny_dirs["tiny"], listen=address)
            assert answer.result().max_model_len > 0
    finally:
        gateway.stop()
        if worker is not None:
            worker.stop()
    gateway = GatewayThread([f"127.0.0.1:{free_port()}"], model=str(tiny_dirs["tiny"]), no_worker_timeout_s=0.3)
    try:
        with grpc.insecure_channel(gateway.address) as channel:
            with pytest.raises(grpc.RpcError) as refused:
                pb_grpc.InferenceStub(channel).GetModelInfo(pb.GetModelInfoRequest(), timeout=30)
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "no worker has been serving for 0.3 s (--no-worker-timeout); try again later; 1 worker: down" \
            in refused.value.details()
    finally:
        gateway.stop()


def test_the_gateways_drain_lets_short_streams_finish_and_ends_the_rest_unavailable(two_workers):
    import asyncio

    from grpc_health.v1 import health_pb2

    from kvserve.services.gateway.server import drain

    fleet = two_workers
    long = Streamed(fleet.stub, request(token_ids=SYSTEM, **greedy(1800)))
    short = Streamed(fleet.stub, request(token_ids=SYSTEM[:20], **greedy(6)))
    wait_until(lambda: long.started() and short.started(), what="both streams under way")
    draining = asyncio.run_coroutine_threadsafe(drain(fleet.gateway.gateway, 1.0), fleet.gateway.loop)
    health = fleet.gateway.gateway.running.health   # what probes read on --health-listen: the main port says GOAWAY
    wait_until(lambda: fleet.gateway.call(health.Check(health_pb2.HealthCheckRequest(), None)).status
               == health_pb2.HealthCheckResponse.NOT_SERVING, what="NOT_SERVING")
    assert short.done.wait(30) and short.code == grpc.StatusCode.OK
    assert long.done.wait(30) and long.code == grpc.StatusCode.UNAVAILABLE
    draining.result(15)
    for w in fleet.workers:
        wait_until(lambda: w.manager.manager.stats().used_pages == 0, what="the worker's pages freed")


def test_a_client_holding_a_connection_to_a_draining_gateway_is_not_failed_by_it(two_workers):
    """Two gateway replicas in front of the same workers, a client's channel knowing both: the
    drain of the one it holds a connection to says GOAWAY, and its next calls go to the other
    without one error (a rolling update of the gateways); its stream there finishes."""
    from kvserve.services.gateway.server import drain

    fleet = two_workers
    other = GatewayThread([w.address for w in fleet.workers], model=fleet.gateway.config.model)
    try:
        other.wait_serving(2)
        with grpc.insecure_channel(f"ipv4:{fleet.gateway.address},{other.address}") as channel:
            stub = pb_grpc.InferenceStub(channel)
            running = Streamed(stub, request(token_ids=SYSTEM, **greedy(40)))
            wait_until(running.started, what="the stream under way")
            draining = asyncio.run_coroutine_threadsafe(drain(fleet.gateway.gateway, 60.0), fleet.gateway.loop)
            wait_until(lambda: fleet.gateway.gateway.servicer.draining, what="the drain to start")
            for i in range(5):
                assert len(generate(stub, request(token_ids=SYSTEM[:10] + [i], **greedy(3))).tokens) == 3
            assert running.done.wait(60) and running.code == grpc.StatusCode.OK
            draining.result(30)
        assert other.gateway.servicer._stats().requests_finished == 5
    finally:
        other.stop()


def test_a_request_id_in_flight_is_refused_through_the_gateway(two_workers):
    fleet = two_workers
    first = Streamed(fleet.stub, request(request_id="twice", token_ids=SYSTEM, **greedy(1500)))
    wait_until(first.started, what="the first stream under way")
    second = Streamed(fleet.stub, request(request_id="twice", token_ids=SYSTEM, **greedy(2)))
    assert second.done.wait(30) and second.code == grpc.StatusCode.ALREADY_EXISTS
    fleet.stub.Cancel(pb.CancelRequest(request_id="twice"), timeout=10)
    assert first.done.wait(30) and first.events[-1].finished.finish_reason == pb.FINISH_REASON_ABORT
    # the refused one's prefill, counted where it was sent, no longer is
    wait_until(lambda: all(w.prefilling == 0 for w in fleet.gateway.fleet.workers.values()),
               what="no prefill of this gateway's left ahead")


def test_a_cancelled_request_id_sent_again_at_once_is_served_through_the_gateway(two_workers):
    """Cancel answers once the worker has the cancel; the stream ends a moment later. The id sent
    again in that moment was ALREADY_EXISTS at the gateway (most tries), where a worker serves it."""
    fleet = two_workers
    for attempt, how in enumerate(["Cancel", "client left"] * 3):
        first = Streamed(fleet.stub, request(request_id="again", token_ids=SYSTEM, **greedy(1500)))
        wait_until(first.started, what="the first stream under way")
        if how == "Cancel":
            fleet.stub.Cancel(pb.CancelRequest(request_id="again"), timeout=10)
        else:   # a client's own deadline or cancel, then its retry under the same id
            first.call.cancel()
        second = Streamed(fleet.stub, request(request_id="again", token_ids=SYSTEM, **greedy(2)))
        assert second.done.wait(30), "the request sent again hung"
        assert second.code == grpc.StatusCode.OK, (attempt, how, second.code)
        assert second.events[-1].finished.usage.completion_tokens == 2
        assert first.done.wait(30)
        if how == "Cancel":
            assert first.events[-1].finished.finish_reason == pb.FINISH_REASON_ABORT
    for w in fleet.workers:
        wait_until(lambda: w.manager.manager.stats().used_pages == 0, what="the worker's pages freed")


def test_a_request_that_waited_for_a_cancelled_id_is_refused_if_a_drain_began_meanwhile(two_workers):
    """The drain was checked only before the wait: such a request was taken while draining."""
    fleet = two_workers
    servicer = fleet.gateway.gateway.servicer
    waited = servicer._cancelled_one_ended

    async def drain_begins_meanwhile(tenant, request_id):
        await waited(tenant, request_id)
        servicer.draining = True

    servicer._cancelled_one_ended = drain_begins_meanwhile
    try:
        s = Streamed(fleet.stub, request(request_id="late", token_ids=SYSTEM, **greedy(2)))
        assert s.done.wait(30) and s.code == grpc.StatusCode.UNAVAILABLE and not s.events
        assert not servicer.relays
    finally:
        servicer._cancelled_one_ended = waited
        servicer.draining = False


def test_tokenize_and_detokenize_answer_as_a_worker_does(two_workers):
    """The gateway answers both with the workers' tokenizer, refusals included."""
    from tests.service.util import rpc_error

    fleet = two_workers
    with grpc.insecure_channel(fleet.workers[0].address) as ch:
        worker = pb_grpc.InferenceStub(ch)
        text = "Hello, wörld! <|assistant|> 123"
        ours = fleet.stub.Tokenize(pb.TokenizeRequest(prompt=text), timeout=10)
        assert ours == worker.Tokenize(pb.TokenizeRequest(prompt=text), timeout=10)
        for skip in (False, True):
            asked = pb.DetokenizeRequest(token_ids=ours.token_ids, skip_special_tokens=skip)
            assert fleet.stub.Detokenize(asked, timeout=10) == worker.Detokenize(asked, timeout=10)
        assert fleet.stub.Detokenize(pb.DetokenizeRequest(token_ids=ours.token_ids), timeout=10).text == text
        for ids in ([5, 1 << 30], [5, -1], [5] * ((1 << 17) + 1)):
            bad = pb.DetokenizeRequest(token_ids=ids)
            theirs, gateways = rpc_error(lambda: worker.Detokenize(bad, timeout=10)), \
                rpc_error(lambda: fleet.stub.Detokenize(bad, timeout=10))
            assert (gateways.code(), gateways.details()) == (theirs.code(), theirs.details())
            assert gateways.code() == grpc.StatusCode.INVALID_ARGUMENT
