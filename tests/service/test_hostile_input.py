"""Hostile input never hurts others: a burst of huge prompts leaves everyone else's time to
first token and gaps between tokens small, and every call ends with a documented code."""

from __future__ import annotations

import asyncio
import json
import random
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from kvserve.inference.v1 import inference_pb2 as pb
from kvserve.inference.v1 import inference_pb2_grpc as pb_grpc
from tests.service.processes import (REPO, children, free_port, kv_stats, kvserve, stop_pids, terminate,
                                     wait_serving)
from tests.service.util import greedy, request, wait_until

pytestmark = pytest.mark.slow

# The bound: two seconds for both time to first token and the largest gap. Before tokenizing
# left the event loop, requests arriving during such a burst waited 19-27 s; a quiet server
# answers in well under a tenth of one. The server runs with --cpu-threads 1, leaving one of the
# 2 cores to its front, as a CPU deployment on a small machine should. What machines show lies
# far below the bound (docs/benchmarks.md, "Faults and hostile input": 0.2-0.7 s from Zen 5 to
# Zen 3), which is set to catch the loop being blocked again, not to time a machine.
BOUND_S = 2.0
BURST = 100
ORDINARY = 16


@pytest.fixture(scope="module")
def served_with_manager(tiny_dirs):
    """`kvserve up` -> (its address, its manager's)."""
    address, kv_address = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
    proc = kvserve("up", "--model", str(tiny_dirs["tiny"]), "--listen", address, "--kvcache-listen", kv_address,
                   "--device", "cpu", "--cpu-threads", "1", "--log-level", "warning")
    kids: list[int] = []
    try:
        wait_serving(address, proc)
        kids = children(proc.pid)
        yield address, kv_address
    finally:
        terminate(proc)
        stop_pids(kids)


def timed_stream(address: str, i: int) -> tuple[float, float, int]:
    """(time to first token, largest gap between tokens, tokens) of one ordinary request."""
    with grpc.insecure_channel(address) as ch:
        start = time.monotonic()
        stamps = []
        for message in pb_grpc.InferenceStub(ch).Generate(
                request(prompt=f"request {i}: the model token cache", **greedy(20)), timeout=60):
            stamps += [time.monotonic()] * len(message.chunk.token_ids)
    gaps = [b - a for a, b in zip(stamps, stamps[1:])]
    return stamps[0] - start, max(gaps), len(stamps)


def test_a_burst_of_huge_prompts_keeps_everyone_elses_latency_small(served_with_manager):
    served, _ = served_with_manager
    burst = subprocess.Popen([sys.executable, "-m", "tests.service.burst_client", served, str(BURST), "7", "1.0"],
                             cwd=REPO, stdout=subprocess.PIPE, text=True)
    try:
        assert burst.stdout.readline().startswith("sending")
        started = time.time()
        with ThreadPoolExecutor(ORDINARY) as pool:
            futures = []
            for i in range(ORDINARY):   # arriving one by one while the burst is received
                futures.append(pool.submit(timed_stream, served, i))
                threading.Event().wait(0.02)
            last_start = time.time()
            results = [f.result(timeout=60) for f in futures]
        kind, ended, codes = burst.stdout.readline().split(" ", 2)
        assert kind == "done" and burst.wait(30) == 0
    finally:
        if burst.poll() is None:
            burst.kill()
    codes = json.loads(codes)
    # The tiny model's length is 2048 tokens: every one of them is too long.
    assert len(codes) >= BURST and set(codes) == {"INVALID_ARGUMENT"}, codes
    assert float(ended) > last_start, "the burst was over before the last ordinary request arrived"
    ttft = max(r[0] for r in results)
    gap = max(r[1] for r in results)
    assert all(r[2] == 20 for r in results)
    assert ttft < BOUND_S and gap < BOUND_S, (f"time to first token up to {ttft:.3f} s, gaps up to {gap:.3f} s "
                                              f"during the burst (bound {BOUND_S} s)")
    print(f"during the burst: time to first token up to {ttft:.3f} s, gaps up to {gap:.3f} s; "
          f"{len(codes)} huge prompts refused in {float(ended) - started:.2f} s")


# ------------------------------------------------------------------- any request at all

DOCUMENTED = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.ALREADY_EXISTS}
INT32, UINT32, UINT64 = (-2**31, 2**31 - 1), (0, 2**32 - 1), (0, 2**64 - 1)


def _mostly(valid, anything):
    """Three times in four a value the server accepts, so that many requests run; else anything."""
    return st.one_of(valid, valid, valid, anything)


def _texts():
    """Short, empty, and huge (a repeated character: cheap to build, 300,000 characters). Any
    character UTF-8 can carry: a lone surrogate cannot be put on the wire at all."""
    return _mostly(st.text(max_size=30),
                   st.builds(lambda c, n: c * n, st.characters(codec="utf-8"), st.integers(0, 300_000)))


def _floats(lo: float, hi: float):
    """One in the valid range, or any float32, NaN and infinities too."""
    return _mostly(st.floats(lo, hi, width=32), st.floats(width=32))


def _ints(lo: int, hi: int, bounds: tuple[int, int]):
    return _mostly(st.integers(lo, hi), st.integers(*bounds))


_sampling = st.fixed_dictionaries({}, optional={
    "temperature": _floats(0, 2), "top_p": _floats(0.125, 1), "top_k": _ints(-1, 50, INT32), "min_p": _floats(0, 1),
    "repetition_penalty": _floats(0.5, 2), "presence_penalty": _floats(-2, 2), "frequency_penalty": _floats(-2, 2),
    "seed": st.integers(*UINT64), "max_tokens": _ints(0, 64, UINT32),
    "stop_token_ids": st.lists(_ints(0, 1023, INT32), max_size=5), "stop": st.lists(_texts(), max_size=70),
    "ignore_eos": st.booleans(), "logprobs": _ints(0, 5, UINT32), "skip_special_tokens": st.booleans(),
    "prompt_logprobs": _ints(0, 5, UINT32), "min_tokens": _ints(0, 8, UINT32),
    "logit_bias": st.dictionaries(_ints(0, 1023, INT32), _floats(-100, 100), max_size=4),
    "structured": st.one_of(
        st.builds(lambda r: pb.StructuredOutput(regex=r), st.text(max_size=20)),
        st.builds(lambda j: pb.StructuredOutput(json_schema=j), st.text(max_size=40)),
        st.builds(lambda g: pb.StructuredOutput(lark_grammar=g), st.text(max_size=40)),
        st.builds(lambda c: pb.StructuredOutput(choice=pb.Choices(choices=c)), st.lists(st.text(max_size=5), max_size=3)),
        st.just(pb.StructuredOutput(json_object=True)))})
_inputs = _mostly(
    st.builds(lambda ids: {"token_ids": ids}, st.lists(st.integers(0, 1023), min_size=1, max_size=40)),
    st.one_of(
        st.none(),
        st.builds(lambda p: {"prompt": p}, _texts()),
        st.builds(lambda ids: {"token_ids": ids}, st.lists(_ints(0, 1023, INT32), max_size=2100)),
        st.builds(lambda ms: {"messages": ms}, st.lists(st.tuples(_texts(), _texts()), max_size=4))))


def _message(request_id, input_, sampling, session_id):
    msg = request(request_id=request_id, **(input_ or {}), **sampling)
    msg.session_id = session_id
    return msg


@pytest.fixture(scope="module")
def in_process(tiny_dirs):
    from tests.service.conftest import ModelServerThread

    server = ModelServerThread(tiny_dirs["tiny"])
    try:
        yield server
    finally:
        server.stop()


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(request_id=_texts(), input_=_inputs, sampling=_sampling, session_id=_texts())
def test_any_generate_request_ends_ok_or_with_a_documented_code(in_process, request_id, input_, sampling, session_id):
    msg = _message(request_id, input_, sampling, session_id)
    with grpc.insecure_channel(in_process.address, options=[("grpc.max_send_message_length", 64 << 20)]) as ch:
        call = pb_grpc.InferenceStub(ch).Generate(msg, timeout=30)
        n = -1
        try:
            for n, _ in enumerate(call):
                if n == 5:   # enough to know it runs; a long generation is not the point
                    call.cancel()
            event("finished")
        except grpc.RpcError as exc:
            code = exc.code()
            if code == grpc.StatusCode.CANCELLED and n == 5:
                event("ran, then cancelled")
                return
            event(f"ended {code.name}: {exc.details()[:40]}")
            assert code in DOCUMENTED, f"{code}: {exc.details()}"
            details = exc.details()
            assert details and "Traceback" not in details and "object at 0x" not in details, details


def test_after_any_requests_the_server_serves_and_holds_no_pages(in_process):
    """Runs after the property test above (pytest keeps the file's order)."""
    from tests.service.util import assert_pages_free, generate

    with grpc.insecure_channel(in_process.address) as ch:
        out = generate(pb_grpc.InferenceStub(ch), request(token_ids=[5, 6, 7], **greedy(4)))
    assert len(out.tokens) == 4
    assert_pages_free(in_process.servicer)
    assert in_process.servicer.engine.counters.failed == 0


# ------------------------------------------------------------------- a storm of clients


async def _storm_call(address: str, i: int, rng: random.Random, codes: list, stub) -> None:
    """One of: run to the end; cancel after a few tokens; a short deadline; drop the connection;
    cancel by id from another call."""
    kind = rng.choice(["finish", "cancel", "deadline", "drop", "cancel-rpc"])
    msg = request(request_id=f"storm-{i}", token_ids=[rng.randrange(3, 1000) for _ in range(rng.randrange(1, 60))],
                  **greedy(rng.randrange(1, 24)))
    own = grpc.aio.insecure_channel(address) if kind == "drop" else None
    call = (pb_grpc.InferenceStub(own) if own else stub).Generate(
        msg, timeout=rng.uniform(0.01, 1.0) if kind == "deadline" else 60)
    stop_after = rng.randrange(0, 4)
    try:
        n = 0
        async for _ in call:
            n += 1
            if n == stop_after:
                if kind == "cancel":
                    call.cancel()
                elif kind == "drop":
                    await own.close()
                elif kind == "cancel-rpc":
                    try:
                        await stub.Cancel(pb.CancelRequest(request_id=msg.request_id), timeout=10)
                    except grpc.aio.AioRpcError as exc:
                        codes.append(exc.code())   # NOT_FOUND when it had just finished
        codes.append(grpc.StatusCode.OK)
    except asyncio.CancelledError:
        codes.append(grpc.StatusCode.CANCELLED)
    except grpc.aio.AioRpcError as exc:
        codes.append(exc.code())
    finally:
        if own is not None:
            await own.close()


def test_a_storm_of_256_streams_leaves_no_error_and_no_page(served_with_manager):
    address, kv_address = served_with_manager
    rng = random.Random(2026)
    codes: list = []

    async def storm() -> None:
        async with grpc.aio.insecure_channel(address) as ch:
            stub = pb_grpc.InferenceStub(ch)
            await asyncio.gather(*[_storm_call(address, i, rng, codes, stub) for i in range(256)])

    asyncio.run(storm())
    seen = set(codes)
    print("storm:", {c.name: codes.count(c) for c in seen})
    assert seen <= {grpc.StatusCode.OK, grpc.StatusCode.CANCELLED, grpc.StatusCode.DEADLINE_EXCEEDED,
                    grpc.StatusCode.NOT_FOUND}, seen
    assert grpc.StatusCode.OK in seen and len(codes) >= 256
    wait_until(lambda: kv_stats(kv_address).used_pages == 0, what="used_pages == 0")
    stats = kv_stats(kv_address)
    assert stats.num_sequences == 0, stats
    with grpc.insecure_channel(address) as ch:
        stub = pb_grpc.InferenceStub(ch)
        server = stub.GetServerStats(pb.GetServerStatsRequest(), timeout=10)
        assert server.requests_failed == 0 and server.running == 0 and server.waiting == 0


def test_a_format_that_compiles_for_minutes_holds_no_text_prompt(tiny_dirs):
    """A small hostile JSON Schema (hundreds of patternProperties) compiles for minutes; it ran on
    the tokenizer lane every text prompt and chat takes, and held them all. Formats compile in a
    lane of their own: here one held until the text prompt behind it has been answered."""
    from tests.service.conftest import ModelServerThread

    server = ModelServerThread(tiny_dirs["tiny"], listen="127.0.0.1:0", kvcache="inprocess", device="cpu",
                               page_size=4, num_pages=128, tokenizer_threads=1)
    grammars = server.servicer.stack.grammars
    release, compiling = threading.Event(), threading.Event()
    real = grammars.matcher

    def slow_matcher(fmt, tenant=""):
        compiling.set()
        assert release.wait(60)
        return real(fmt, tenant)
    grammars.matcher = slow_matcher
    try:
        with grpc.insecure_channel(server.address) as ch:
            stub = pb_grpc.InferenceStub(ch)
            formatted = ThreadPoolExecutor(1).submit(lambda: list(stub.Generate(
                request(prompt="x", structured=pb.StructuredOutput(regex="ab"), **greedy(4)), timeout=60)))
            assert compiling.wait(30)
            assert stub.Tokenize(pb.TokenizeRequest(prompt="a text prompt"), timeout=10).token_ids
            release.set()
            assert formatted.result(60)[-1].finished.usage.completion_tokens <= 4
    finally:
        release.set()
        server.stop()
