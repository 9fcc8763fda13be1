"""The model service's life beyond single calls: draining on shutdown, and a failed
engine step (a bug, a lost manager) that must end the streams in flight with a status
and leave the engine serving, and idle when there is nothing to do."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from kvserve.inference.v1 import inference_pb2 as pb
from kvserve.inference.v1 import inference_pb2_grpc as pb_grpc
from kvserve.services.plumbing.grpc_server import stop_gracefully
from tests.service.util import assert_pages_free, generate, greedy, request, rpc_error, wait_until

PROMPT = [17, 4, 250, 999, 31, 8, 77]


def _stream_until_chunk(stub, msg, timeout: float = 60):
    call = stub.Generate(msg, timeout=timeout)
    events = []
    for event in call:
        events.append(event)
        if event.HasField("chunk"):
            return call, events
    raise AssertionError("the stream ended before its first chunk")


def test_drain_refuses_new_calls_and_lets_running_ones_finish(fresh_server):
    address, servicer = fresh_server
    with grpc.insecure_channel(address) as ch:
        stub = pb_grpc.InferenceStub(ch)
        short, events = _stream_until_chunk(stub, request(token_ids=PROMPT, **greedy(30)))
        servicer.drain()
        err = rpc_error(lambda: stub.Generate(request(token_ids=PROMPT, **greedy(3)), timeout=10))
        assert err.code() == grpc.StatusCode.UNAVAILABLE
        assert "draining" in err.details()
        events += list(short)  # the running call is not cut
        assert events[-1].finished.finish_reason == pb.FINISH_REASON_LENGTH
        assert sum(len(e.chunk.token_ids) for e in events if e.HasField("chunk")) == 30
        # the other RPCs still answer while draining
        assert stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=10).page_size == 4


def test_graceful_stop_ends_a_long_call_with_unavailable_and_frees_its_pages(tiny_dirs):
    from tests.service.conftest import ModelServerThread

    server = ModelServerThread(tiny_dirs["tiny"])
    try:
        with grpc.insecure_channel(server.address) as ch:
            stub = pb_grpc.InferenceStub(ch)
            call, _ = _stream_until_chunk(stub, request(token_ids=PROMPT, **greedy(1900)))
            server.servicer.drain()
            stopping = asyncio.run_coroutine_threadsafe(
                stop_gracefully(server.running.server, server.running.health, 0.3), server.loop)
            with pytest.raises(grpc.RpcError) as info:
                for _ in call:
                    pass
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE
            stopping.result(10)
        wait_until(lambda: server.servicer.engine.counters.aborted == 1, what="the abort")
        assert_pages_free(server.servicer)
    finally:
        server.stop()


def _fail_forward(servicer, when):
    """The first forward pass whose work meets `when` raises (as a CUDA error or a bug
    would); the passes before it and after it run."""
    runner = servicer.engine.runner
    execute, calls = runner.execute, {"n": 0, "failed": False}

    def failing(work):
        calls["n"] += 1
        if not calls["failed"] and when(calls["n"], work):
            calls["failed"] = True
            raise RuntimeError("injected failure")
        return execute(work)

    runner.execute = failing


def _fail_fifth_forward(servicer):
    _fail_forward(servicer, lambda n, work: n == 5)


def _fail_once_three_run(servicer):
    """The first forward pass of a batch that holds three requests fails, however late the
    third call reaches the engine (a slow machine's fifth pass may come before it)."""
    _fail_forward(servicer, lambda n, work: len({w.request.request_id for w in work}) == 3)


def test_failed_step_ends_streams_with_internal_and_the_engine_serves_on(fresh_server, caplog):
    address, servicer = fresh_server
    with grpc.insecure_channel(address) as ch:
        stub = pb_grpc.InferenceStub(ch)
        solo = generate(stub, request(token_ids=PROMPT, **greedy(12))).tokens
        _fail_once_three_run(servicer)
        calls = [stub.Generate(request(token_ids=PROMPT + [i], **greedy(200)), timeout=30) for i in range(3)]
        for call in calls:
            events = []
            with pytest.raises(grpc.RpcError) as info:
                for event in call:
                    events.append(event)
            # a status, never an error message inside the stream
            assert info.value.code() == grpc.StatusCode.INTERNAL
            details = info.value.details()
            # a message for a person, naming the incident the log files the traceback under
            assert details.startswith("internal error (the engine step failed)"), details
            assert "RuntimeError" not in details and "injected" not in details
            incident = details.rsplit(" ", 1)[1]
            assert any(incident in r.getMessage() and r.exc_info for r in caplog.records)
            assert not any(e.HasField("finished") for e in events)
        # a new epoch, a clean manager, and the same tokens as before
        again = generate(stub, request(token_ids=PROMPT, **greedy(12)))
        assert again.tokens == solo


def test_engine_goes_idle_after_a_failed_step(fresh_server):
    address, servicer = fresh_server
    engine = servicer.engine
    with grpc.insecure_channel(address) as ch:
        stub = pb_grpc.InferenceStub(ch)
        _fail_fifth_forward(servicer)
        with pytest.raises(grpc.RpcError):
            for _ in stub.Generate(request(token_ids=PROMPT, **greedy(40)), timeout=30):
                pass
        generate(stub, request(token_ids=PROMPT, **greedy(4)))
    assert engine.wait_idle(2), "the engine never went idle after recovering"
    steps = engine.counters.steps
    time.sleep(0.3)
    assert engine.counters.steps == steps, "the engine keeps stepping with nothing to do"
    assert_pages_free(servicer)


def test_the_model_is_built_on_a_thread_that_ends(tiny_dirs, monkeypatch):
    # A live thread that ran torch keeps an idle OpenMP pool, which makes libgomp stop
    # spinning between the engine's parallel regions (assembly.build_on_a_thread_that_ends).
    import threading

    from kvserve.model_service import assembly
    from tests.service.conftest import ModelServerThread

    built_on = []
    real_build = assembly.build
    monkeypatch.setattr(assembly, "build", lambda config, on_step_end: (
        built_on.append(threading.current_thread()) or real_build(config, on_step_end)))
    server = ModelServerThread(tiny_dirs["tiny"])
    try:
        [thread] = built_on
        assert thread is not server.servicer.engine._thread and not thread.is_alive()
    finally:
        server.stop()


def test_a_build_error_reaches_the_caller(tmp_path):
    from kvserve.model_service.assembly import build_on_a_thread_that_ends
    from kvserve.model_service.config import ModelServiceConfig

    with pytest.raises(ValueError, match="neither a built-in model"):
        build_on_a_thread_that_ends(ModelServiceConfig(model=str(tmp_path / "missing")))


def test_a_cpu_gemm_that_cannot_run_is_refused_at_build(tiny_dirs):
    from kvserve.model_service.assembly import build_on_a_thread_that_ends
    from kvserve.model_service.config import ModelServiceConfig

    with pytest.raises(ValueError, match="--cpu-gemm must be auto, onednn, native or torch, got 'mkl'"):
        ModelServiceConfig(cpu_gemm="mkl")
    with pytest.raises(ValueError, match="native CPU GEMM cannot run here: it runs float32, not torch.bfloat16"):
        build_on_a_thread_that_ends(ModelServiceConfig(model=str(tiny_dirs["tiny"]), kvcache="inprocess",
                                                       device="cpu", dtype="bfloat16", cpu_gemm="native"))


def test_drain_says_not_serving_lets_short_calls_finish_and_ends_the_rest_unavailable(tiny_dirs):
    """NOT_SERVING on the probes' port; the main one says GOAWAY (a client's next call goes
    elsewhere: the next test); the calls in flight finish or end UNAVAILABLE saying why."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from kvserve.model_service.server import drain
    from tests.service.conftest import ModelServerThread
    from tests.service.processes import free_port

    probes = f"127.0.0.1:{free_port()}"
    server = ModelServerThread(tiny_dirs["tiny"], health_listen=probes)
    try:
        with grpc.insecure_channel(server.address) as ch, grpc.insecure_channel(probes) as probe_ch:
            stub, health = pb_grpc.InferenceStub(ch), health_pb2_grpc.HealthStub(probe_ch)
            serving = lambda: health.Check(health_pb2.HealthCheckRequest(), timeout=5).status  # noqa: E731
            assert serving() == health_pb2.HealthCheckResponse.SERVING
            long_call, _ = _stream_until_chunk(stub, request(token_ids=PROMPT, **greedy(1900)))
            short_call, short_events = _stream_until_chunk(stub, request(token_ids=PROMPT + [5], **greedy(8)))
            draining = asyncio.run_coroutine_threadsafe(drain(server.running, server.servicer, 1.0), server.loop)
            wait_until(lambda: serving() == health_pb2.HealthCheckResponse.NOT_SERVING, what="NOT_SERVING")
            from kvserve.model_service.cache_events import SERVICE_NAME as EVENTS
            for name in (EVENTS, "kvserve.inference.v1.Inference"):   # each service by name, as "" says
                assert health.Check(health_pb2.HealthCheckRequest(service=name), timeout=5).status == \
                    health_pb2.HealthCheckResponse.NOT_SERVING, name
            err = rpc_error(lambda: stub.Generate(request(token_ids=PROMPT, **greedy(3)), timeout=10))
            assert err.code() == grpc.StatusCode.UNAVAILABLE   # nowhere else to go: no server listens
            short_events += list(short_call)
            assert short_events[-1].finished.finish_reason == pb.FINISH_REASON_LENGTH
            with pytest.raises(grpc.RpcError) as info:
                for _ in long_call:
                    pass
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE
            assert info.value.details() == ("the server shut down before the request finished "
                                            "(it was given 1 s to finish)")
            draining.result(15)
        assert_pages_free(server.servicer)
    finally:
        server.stop()


def test_a_client_holding_a_connection_to_a_draining_server_is_not_failed_by_it(tiny_dirs):
    """GOAWAY at the drain's start: a client whose channel knows another server sends its next
    calls there without one error, where a refusal on the held connection failed each call
    until the server stopped; its stream on the draining one finishes there."""
    from kvserve.model_service.server import drain
    from tests.service.conftest import ModelServerThread
    from tests.service.processes import free_port

    servers = []
    try:
        for _ in range(2):
            servers.append(ModelServerThread(tiny_dirs["tiny"], listen=f"127.0.0.1:{free_port()}"))
        first, second = servers
        target = f"ipv4:{first.address},{second.address}"   # pick_first: every call to the first while it serves
        with grpc.insecure_channel(target) as ch:
            stub = pb_grpc.InferenceStub(ch)
            running, events = _stream_until_chunk(stub, request(token_ids=PROMPT, **greedy(40)))
            assert first.servicer.engine.num_live() == 1
            draining = asyncio.run_coroutine_threadsafe(drain(first.running, first.servicer, 60.0), first.loop)
            wait_until(lambda: first.servicer.draining, what="the drain to start")
            for i in range(5):
                out = generate(stub, request(token_ids=PROMPT + [i], **greedy(3)))
                assert len(out.tokens) == 3
            events += list(running)
            assert events[-1].finished.finish_reason == pb.FINISH_REASON_LENGTH
            draining.result(30)
        assert second.servicer.engine.counters.finished == 5
    finally:
        for server in servers:
            server.stop()


def test_the_probe_port_answers_until_the_drain_ends_not_the_last_grpc_call(tiny_dirs):
    """Work that is no gRPC call (an HTTP stream, a lane's) outlasts the server's last call: the
    probe port closed with that last call (at once here, with none), and a liveness probe refused
    for the rest of the drain reads as a dead process."""
    import http.client
    import json

    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from kvserve.model_service.server import drain
    from tests.service.conftest import ModelServerThread
    from tests.service.processes import free_port

    probes = f"127.0.0.1:{free_port()}"
    server = ModelServerThread(tiny_dirs["tiny"], health_listen=probes, http_listen="127.0.0.1:0")
    try:
        host, port = server.servicer.http_front.address.rsplit(":", 1)
        conn = http.client.HTTPConnection(host, int(port), timeout=60)
        conn.request("POST", "/v1/completions", body=json.dumps(
            {"prompt": "hello", "max_tokens": 1200, "ignore_eos": True, "stream": True}).encode(),
            headers={"content-type": "application/json"})
        answer = conn.getresponse()
        assert answer.readline().startswith(b"data: ")
        draining = asyncio.run_coroutine_threadsafe(drain(server.running, server.servicer, 60.0), server.loop)
        server.call(asyncio.wait_for(server.running.server.wait_for_termination(), 10))   # no gRPC call holds it
        assert server.servicer.engine.num_live() == 1
        with grpc.insecure_channel(probes) as probe_ch:
            status = health_pb2_grpc.HealthStub(probe_ch).Check(health_pb2.HealthCheckRequest(), timeout=5).status
        assert status == health_pb2.HealthCheckResponse.NOT_SERVING
        assert answer.read().rstrip().endswith(b"data: [DONE]")
        conn.close()
        draining.result(30)
        with grpc.insecure_channel(probes) as probe_ch:   # the drain over: the probe port closes with it
            stub = health_pb2_grpc.HealthStub(probe_ch)

            def refused() -> bool:
                try:
                    stub.Check(health_pb2.HealthCheckRequest(), timeout=1)
                except grpc.RpcError as exc:
                    return exc.code() == grpc.StatusCode.UNAVAILABLE
                return False
            wait_until(refused, what="the probe port closed")
    finally:
        server.stop()


def test_a_hurried_drain_ends_the_streams_at_once_saying_so(tiny_dirs):
    """Ctrl-C twice (wait_for_signal's event): the grace period is cut short, and what runs ends
    UNAVAILABLE saying the server was stopped, not that it had its grace period."""
    import time

    from kvserve.model_service.server import drain
    from tests.service.conftest import ModelServerThread

    server = ModelServerThread(tiny_dirs["tiny"])
    try:
        with grpc.insecure_channel(server.address) as ch:
            long_call, _ = _stream_until_chunk(pb_grpc.InferenceStub(ch), request(token_ids=PROMPT, **greedy(1900)))
            hurry = asyncio.Event()
            draining = asyncio.run_coroutine_threadsafe(drain(server.running, server.servicer, 600.0, hurry),
                                                        server.loop)
            start = time.monotonic()
            server.loop.call_soon_threadsafe(hurry.set)
            with pytest.raises(grpc.RpcError) as info:
                for _ in long_call:
                    pass
            assert (info.value.code(), info.value.details()) == (
                grpc.StatusCode.UNAVAILABLE, "the server was stopped before the request finished"), info.value
            draining.result(30)
            assert time.monotonic() - start < 60   # not the 600 s grace
        assert_pages_free(server.servicer)
    finally:
        server.stop()


def test_drain_waits_for_every_call_to_return_before_the_server_stops(tiny_dirs, monkeypatch):
    """The engine has ended a call's request, but the call itself is slow to say so (a busy
    loop): the drain still lets it return its status instead of cancelling it at stop."""
    from kvserve.model_service import servicer as servicer_module
    from kvserve.model_service.server import drain
    from tests.service.conftest import ModelServerThread

    slow_abort = servicer_module.abort

    async def late(context, error):
        await asyncio.sleep(1.5)   # longer than the server's own 1 s grace at stop
        await slow_abort(context, error)

    monkeypatch.setattr(servicer_module, "abort", late)
    server = ModelServerThread(tiny_dirs["tiny"])
    try:
        with grpc.insecure_channel(server.address) as ch:
            long_call, _ = _stream_until_chunk(pb_grpc.InferenceStub(ch), request(token_ids=PROMPT, **greedy(1900)))
            draining = asyncio.run_coroutine_threadsafe(drain(server.running, server.servicer, 0.2), server.loop)
            with pytest.raises(grpc.RpcError) as info:
                for _ in long_call:
                    pass
            assert (info.value.code(), info.value.details()) == (
                grpc.StatusCode.UNAVAILABLE, "the server shut down before the request finished "
                "(it was given 0.2 s to finish)"), info.value
            draining.result(15)
            assert server.servicer.open_streams == 0
    finally:
        server.stop()


def test_a_stalled_forward_turns_readiness_and_liveness_not_serving_until_it_moves(tiny_dirs):
    import threading

    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from tests.service.conftest import ModelServerThread

    server = ModelServerThread(tiny_dirs["tiny"], stall_timeout_s=0.5)
    runner = server.servicer.engine.runner
    execute, release = runner.execute, threading.Event()
    runner.execute = lambda work: release.wait(30) and execute(work)
    try:
        with grpc.insecure_channel(server.address) as ch:
            health = health_pb2_grpc.HealthStub(ch)

            def status(service: str) -> int:
                return health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5).status

            call = pb_grpc.InferenceStub(ch).Generate(request(token_ids=PROMPT, **greedy(4)), timeout=60)
            NOT_SERVING, SERVING = health_pb2.HealthCheckResponse.NOT_SERVING, health_pb2.HealthCheckResponse.SERVING
            wait_until(lambda: status("liveness") == NOT_SERVING, what="liveness NOT_SERVING")
            assert status("") == NOT_SERVING
            release.set()
            assert len([e for e in call if e.HasField("chunk")]) >= 1
            wait_until(lambda: status("liveness") == SERVING and status("") == SERVING, what="SERVING again")
    finally:
        release.set()
        server.stop()


def test_steps_that_compute_nothing_for_live_requests_are_a_stall_too(tiny_dirs):
    """A livelock (the engine stepping with nothing to compute while requests wait, as a swapped
    queue whose head could never resume made) turns health NOT_SERVING like a stuck forward; an
    idle engine's empty steps do not."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from tests.service.conftest import ModelServerThread

    from kvserve.kvcache_service.contract.types import StepRequest
    from kvserve.model_service.engine.scheduler import Proposal

    server = ModelServerThread(tiny_dirs["tiny"], stall_timeout_s=0.5)
    scheduler = server.servicer.engine.scheduler
    build, stuck = scheduler.build, {"on": True}
    # every request waits: each step proposes nothing (a request's pages never come)
    scheduler.build = lambda: Proposal(StepRequest(scheduler.epoch), []) if stuck["on"] else build()
    try:
        with grpc.insecure_channel(server.address) as ch:
            health = health_pb2_grpc.HealthStub(ch)

            def status(service: str) -> int:
                return health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5).status

            NOT_SERVING, SERVING = health_pb2.HealthCheckResponse.NOT_SERVING, health_pb2.HealthCheckResponse.SERVING
            call = pb_grpc.InferenceStub(ch).Generate(request(token_ids=PROMPT, **greedy(4)), timeout=60)
            wait_until(lambda: status("liveness") == NOT_SERVING, what="liveness NOT_SERVING")
            assert "computed nothing" in server.servicer.engine.problem()
            assert "nothing to compute" in server.servicer.engine.problem()
            call.cancel()
            wait_until(lambda: server.servicer.engine.num_live() == 0, what="the request gone")
            wait_until(lambda: status("liveness") == SERVING and status("") == SERVING, what="SERVING again")
    finally:
        stuck["on"] = False
        server.stop()


def test_a_failed_step_with_a_remote_manager_leaves_no_stale_answer_behind(tiny_dirs, tmp_path):
    """A forward fails with the next Step already sent to a manager in its own server: its
    answer still comes on the stream, and the engine, starting clean, must not take it for the
    answer to its next Step."""
    from kvserve.kvcache_service.core import ManagerConfig
    from tests.kvcache.conftest import ServerThread
    from tests.service.conftest import ModelServerThread

    manager = ServerThread(f"unix://{tmp_path}/kv.sock", ManagerConfig(num_pages=512, page_size=4, max_seqs=64))
    model = ModelServerThread(tiny_dirs["tiny"], kvcache=manager.address)   # 512 pages of 4, as the manager
    try:
        with grpc.insecure_channel(model.address) as ch:
            stub = pb_grpc.InferenceStub(ch)
            solo = generate(stub, request(token_ids=PROMPT, **greedy(12))).tokens
            _fail_once_three_run(model.servicer)
            calls = [stub.Generate(request(token_ids=PROMPT + [i], **greedy(200)), timeout=30) for i in range(3)]
            for call in calls:
                with pytest.raises(grpc.RpcError) as info:
                    for _ in call:
                        pass
                assert info.value.code() == grpc.StatusCode.INTERNAL
            for _ in range(3):   # every later step answered with its own plan
                assert generate(stub, request(token_ids=PROMPT, **greedy(12))).tokens == solo
        assert model.servicer.engine.counters.failed == 3
    finally:
        model.stop()
        manager.stop()
