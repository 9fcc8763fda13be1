"""A Generate call that ends early (cancelled, channel closed, deadline passed) aborts its
request, and its KV pages go back: the in-process manager then holds no sequence and no
page, and the engine counts the abort.

Each test waits for the abort to be counted before waiting for the engine to go idle:
the server notices a vanished client asynchronously, so "idle" alone could be observed
before the cancellation reached the engine.
"""

from __future__ import annotations

import random
import threading
from concurrent.futures import ThreadPoolExecutor

import grpc

from kvserve.inference.v1 import inference_pb2 as pb
from kvserve.inference.v1 import inference_pb2_grpc as pb_grpc
from tests.service.util import assert_pages_free, generate, greedy, request, wait_until

LONG = 1900  # tokens: seconds of generation on CPU, never reached in these tests
_rng = random.Random(77)
LONG_PROMPT = [_rng.randrange(3, 1024) for _ in range(30)]
SHORT_PROMPT = LONG_PROMPT[:12]
# Fixed at import, so a test's prompts do not depend on which tests ran before it. Greedy
# top-2 margins along these continuations are >= 2e-3, far above float32 batching noise,
# so batched tokens must equal solo tokens exactly.
EIGHT_PROMPTS = [[_rng.randrange(3, 1024) for _ in range(n)] for n in (5, 9, 14, 21, 26, 33, 40, 47)]


def _aborted(servicer) -> int:
    return servicer.engine.counters.aborted


def _expect_abort_and_free_pages(stub, servicer, aborted_before: int, n: int = 1) -> None:
    wait_until(lambda: _aborted(servicer) >= aborted_before + n, timeout=10, what="the abort")
    assert _aborted(servicer) == aborted_before + n
    assert_pages_free(servicer)
    stats = stub.GetServerStats(pb.GetServerStatsRequest(), timeout=10)
    assert stats.requests_aborted == aborted_before + n
    assert stats.running == 0 and stats.waiting == 0
    assert stats.kvcache.used_pages == 0 and stats.kvcache.num_sequences == 0


def _running_call(stub, prompt, chunks: int = 3, **kw):
    """A long greedy stream, read until `chunks` chunks arrived (its pages are held)."""
    call = stub.Generate(request(token_ids=prompt, **greedy(LONG)), **kw)
    seen = 0
    for event in call:
        seen += event.HasField("chunk")
        if seen == chunks:
            return call
    raise AssertionError("the stream ended early")


def _holds_pages(servicer) -> bool:
    return servicer.engine.num_running == 1


def test_client_cancel_aborts_and_frees_pages(stub, model_server):
    servicer = model_server.servicer
    before = _aborted(servicer)
    call = _running_call(stub, LONG_PROMPT, timeout=60)
    assert _holds_pages(servicer)
    call.cancel()
    try:
        for _ in call:
            pass
        raise AssertionError("the cancelled stream went on")
    except grpc.RpcError as exc:
        assert exc.code() == grpc.StatusCode.CANCELLED
    _expect_abort_and_free_pages(stub, servicer, before)


def test_closed_channel_aborts_and_frees_pages(stub, model_server):
    servicer = model_server.servicer
    before = _aborted(servicer)
    own = grpc.insecure_channel(model_server.address)
    call = _running_call(pb_grpc.InferenceStub(own), LONG_PROMPT, timeout=60)
    assert _holds_pages(servicer)
    own.close()
    _expect_abort_and_free_pages(stub, servicer, before)
    del call


def test_expired_deadline_aborts_and_frees_pages(stub, model_server):
    servicer = model_server.servicer
    before = _aborted(servicer)
    call = stub.Generate(request(token_ids=LONG_PROMPT, **greedy(LONG)), timeout=0.3)
    chunks = 0
    try:
        for event in call:
            chunks += event.HasField("chunk")
        raise AssertionError("a 1900-token generation finished within 0.3 s")
    except grpc.RpcError as exc:
        assert exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert chunks > 0  # it was running when the deadline passed
    _expect_abort_and_free_pages(stub, servicer, before)


def test_cancel_rpc_then_client_cancel_counts_one_abort(stub, model_server):
    """Cancel by id, then the client gives up too: one abort, not two, and no error."""
    servicer = model_server.servicer
    before = _aborted(servicer)
    call = stub.Generate(request(token_ids=SHORT_PROMPT, request_id="twice", **greedy(LONG)), timeout=60)
    assert next(call).HasField("prefill_done")
    stub.Cancel(pb.CancelRequest(request_id="twice"), timeout=10)
    call.cancel()
    _expect_abort_and_free_pages(stub, servicer, before)


def test_half_of_eight_streams_cancelled_midway(stub, model_server):
    servicer = model_server.servicer
    prompts = EIGHT_PROMPTS
    n_tokens = 24
    keep = [0, 2, 5, 7]
    solo = {i: generate(stub, request(token_ids=prompts[i], **greedy(n_tokens))).tokens for i in keep}
    assert_pages_free(servicer)
    before = _aborted(servicer)
    # all eight hold pages at once before anyone is cancelled
    all_started = threading.Barrier(8, timeout=30)

    def run(i: int):
        if i in keep:
            call = stub.Generate(request(token_ids=prompts[i], **greedy(n_tokens)), timeout=60)
            events = []
            for event in call:
                events.append(event)
                if event.HasField("prefill_done"):
                    all_started.wait()
            return events
        call = stub.Generate(request(token_ids=prompts[i], **greedy(LONG)), timeout=60)
        chunks = 0
        for event in call:
            if event.HasField("prefill_done"):
                all_started.wait()
            chunks += event.HasField("chunk")
            if chunks == 4:
                call.cancel()
                break
        try:
            for _ in call:
                pass
        except grpc.RpcError as exc:
            return exc.code()
        return None

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(run, range(8)))
    for i, result in enumerate(results):
        if i in keep:
            finished = result[-1].finished
            tokens = [t for e in result if e.HasField("chunk") for t in e.chunk.token_ids]
            assert finished.finish_reason == pb.FINISH_REASON_LENGTH, i
            assert tokens == solo[i], f"stream {i}: batched {tokens} != solo {solo[i]}"
            assert finished.usage.completion_tokens == n_tokens
        else:
            assert result == grpc.StatusCode.CANCELLED, (i, result)
    _expect_abort_and_free_pages(stub, servicer, before, n=4)
