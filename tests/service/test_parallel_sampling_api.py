"""SamplingParams.n over real sockets: through the model service, the gateway, the HTTP front and
the SDK, every sequence tagged with its index, one finished each, the prompt counted once."""

from __future__ import annotations

import grpc
import openai
import pytest

from kvserve.clients.inference_client import InferenceClient
from kvserve.inference.v1 import inference_pb2 as pb
from kvserve.model_service.engine.family import child_seed
from tests.gateway.conftest import make_fleet
from tests.service.conftest import ModelServerThread
from tests.service.util import assert_pages_free, generate, greedy, request, rpc_error, wait_until

PROMPT = list(range(40, 63))   # 23 tokens: the fork point is inside a page


def by_index(stream) -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for e in stream.events:
        if e.HasField("chunk"):
            out.setdefault(e.index, []).extend(e.chunk.token_ids)
    return out


def check_shape(stream, n: int, max_tokens: int) -> None:
    kinds = stream.kinds
    assert kinds[0] == "prefill_done" and kinds.count("prefill_done") == 1
    finished = [e for e in stream.events if e.HasField("finished")]
    assert sorted(e.index for e in finished) == list(range(n))
    assert stream.events[-1].HasField("finished")
    for e in finished:
        assert e.finished.usage.completion_tokens == max_tokens
        assert e.finished.usage.prompt_tokens == len(PROMPT)


@pytest.fixture(scope="module")
def server(tiny_dirs):
    s = ModelServerThread(tiny_dirs["tiny"], max_n=8, metrics_listen="127.0.0.1:0")
    try:
        yield s
    finally:
        s.stop()


@pytest.fixture(scope="module")
def stub(server):
    with grpc.insecure_channel(server.address) as ch:
        from kvserve.inference.v1 import inference_pb2_grpc as pb_grpc

        yield pb_grpc.InferenceStub(ch)


def test_n_sequences_over_grpc(server, stub):
    single = generate(stub, request(token_ids=PROMPT, **greedy(9))).tokens
    out = generate(stub, request(token_ids=PROMPT, n=4, **greedy(9)))
    check_shape(out, 4, 9)
    assert by_index(out) == {i: single for i in range(4)}
    seeded = generate(stub, request(token_ids=PROMPT, n=3, seed=7, temperature=1.0, max_tokens=9, ignore_eos=True))
    check_shape(seeded, 3, 9)
    for i, tokens in by_index(seeded).items():
        alone = generate(stub, request(token_ids=PROMPT, seed=child_seed(7, i), temperature=1.0, max_tokens=9,
                                       ignore_eos=True))
        assert tokens == alone.tokens, f"sequence {i}"
    assert_pages_free(server.servicer)
    import urllib.request

    text = urllib.request.urlopen(f"http://{server.servicer.metrics_endpoint.address}/metrics", timeout=10).read()
    text = text.decode()
    assert "kvserve:parallel_sampling_forks_total 5.0" in text   # 3 + 2 children
    assert 'kvserve:request_params_n_bucket{le="4.0"}' in text


@pytest.mark.parametrize("msg, words", [
    (request(token_ids=PROMPT, n=9, **greedy(4)), "n must be an integer in [1, 8]"),
    (request(token_ids=PROMPT, request_id="a\x01b", **greedy(4)), "control characters"),
])
def test_bad_n_and_ids_are_invalid_argument(stub, msg, words):
    err = rpc_error(lambda: generate(stub, msg))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and words in err.details()


def test_a_continuation_with_n_is_refused(stub):
    msg = request(token_ids=PROMPT, n=2, **greedy(6))
    msg.continuation.ids.extend([5, 6])
    err = rpc_error(lambda: generate(stub, msg))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "n > 1" in err.details()


def test_cancelling_the_call_frees_every_sequence(server, stub):
    call = stub.Generate(request(token_ids=PROMPT, n=4, **greedy(1500)), timeout=60)
    seen = set()
    for event in call:
        if event.HasField("chunk"):
            seen.add(event.index)
        if len(seen) == 4:
            break
    call.cancel()
    wait_until(lambda: server.servicer.engine.num_live() == 0, what="the request ended")
    assert_pages_free(server.servicer)


def test_the_sdk_collects_each_sequence(server):
    with InferenceClient(server.address, timeout=60) as client:
        done = client.complete(token_ids=PROMPT, n=3, temperature=0, max_tokens=6, ignore_eos=True)
        one = client.complete(token_ids=PROMPT, temperature=0, max_tokens=6, ignore_eos=True)
    assert [c.token_ids for c in done.choices] == [one.token_ids] * 3
    assert [c.finished.index for c in done.choices] == [0, 1, 2] and done.token_ids == one.token_ids
    assert one.choices == ()


def test_n_through_the_gateway_and_http(tiny_dirs):
    for fleet in make_fleet(tiny_dirs["tiny"], 2, http_listen="127.0.0.1:0"):
        single = generate(fleet.stub, request(token_ids=PROMPT, **greedy(8))).tokens
        out = generate(fleet.stub, request(token_ids=PROMPT, n=3, **greedy(8)))
        check_shape(out, 3, 8)
        assert by_index(out) == {i: single for i in range(3)}
        stats = fleet.stub.GetServerStats(pb.GetServerStatsRequest(), timeout=10)
        assert sum(w.requests_routed for w in stats.workers) == 2   # one request each, whatever its n
        base = f"http://{fleet.gateway.gateway.http_front.address}/v1"
        with openai.OpenAI(base_url=base, api_key="none", max_retries=0, timeout=60) as c:
            model = c.models.list().data[0].id
            whole = c.completions.create(model=model, prompt=PROMPT, max_tokens=8, temperature=0, n=3)
            chunks = list(c.chat.completions.create(
                model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=5, temperature=0, n=2,
                stream=True, stream_options={"include_usage": True}))
        assert [ch.index for ch in whole.choices] == [0, 1, 2]
        assert len({ch.text for ch in whole.choices}) == 1 and whole.usage.completion_tokens == 24
        texts: dict[int, str] = {}
        for chunk in chunks:
            for ch in chunk.choices:
                texts[ch.index] = texts.get(ch.index, "") + (ch.delta.content or "")
        assert sorted(texts) == [0, 1] and texts[0] == texts[1]
        assert chunks[-1].usage.completion_tokens == 10
        finishes = [ch.finish_reason for chunk in chunks for ch in chunk.choices if ch.finish_reason]
        assert finishes == ["length", "length"]
        for w in fleet.workers:
            wait_until(lambda: w.manager.manager.stats().used_pages == 0, what="the worker's pages freed")
