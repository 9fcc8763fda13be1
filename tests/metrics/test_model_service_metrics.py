"""The model service's /metrics after real traffic: counts, cache hits and histograms move as
the requests say they should."""

from __future__ import annotations

import random

import pytest

from tests.metrics.scrape import scrape, value
from tests.service.conftest import ModelServerThread
from tests.service.util import generate, greedy, request
from kvserve.inference.v1 import inference_pb2_grpc as pb_grpc

import grpc


@pytest.fixture(scope="module")
def served(tiny_dirs):
    server = ModelServerThread(tiny_dirs["tiny"], metrics_listen="127.0.0.1:0")
    try:
        yield server
    finally:
        server.stop()


def test_series_move_with_requests_and_a_repeated_prompt_hits(served):
    address = served.servicer.metrics_endpoint.address
    before = scrape(address)
    assert value(before, "kvserve:num_requests_running") == 0
    assert value(before, "kvserve:kv_cache_usage_perc") == 0
    rng = random.Random(4)
    prompt = [rng.randrange(3, 1024) for _ in range(40)]
    with grpc.insecure_channel(served.address) as ch:
        stub = pb_grpc.InferenceStub(ch)
        first = generate(stub, request(token_ids=prompt, **greedy(12)))
        second = generate(stub, request(token_ids=prompt, **greedy(12)))
    assert second.prefill.cached_tokens > 0 and first.tokens == second.tokens
    after = scrape(address)

    def moved(name: str, **labels: str) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    assert moved("kvserve:prompt_tokens_total") == 80
    assert moved("kvserve:prefix_cache_queries_total") == 80
    assert moved("kvserve:prefix_cache_hits_total") == second.prefill.cached_tokens
    assert moved("kvserve:generation_tokens_total") == 24
    assert value(after, "kvserve:request_success_total", finished_reason="length") >= 2
    for name in ("time_to_first_token_seconds", "e2e_request_latency_seconds", "request_queue_time_seconds",
                 "request_prompt_tokens", "request_generation_tokens"):
        assert moved(f"kvserve:{name}_count") == 2, name
    assert moved("kvserve:inter_token_latency_seconds_count") == 22   # 11 gaps in each of 2 streams
    assert moved("kvserve:request_generation_tokens_sum") == 24
    assert value(after, "kvserve:request_prompt_tokens_bucket", le="50.0") - \
        value(before, "kvserve:request_prompt_tokens_bucket", le="50.0") == 2
    assert value(after, "kvserve:num_requests_running") == 0 and value(after, "kvserve:manager_reachable") == 1
    assert value(after, "kvserve:num_preemptions_total", mode="recompute") == 0
    # most steps of one decoding stream ask the manager nothing and are not sent
    steps, sent = moved("kvserve:engine_steps_total"), moved("kvserve:engine_manager_steps_total")
    assert 0 < sent < steps, (sent, steps)
    assert moved("kvserve:engine_phase_seconds_total", phase="forward") > 0


def test_refused_calls_are_counted_by_their_code(served):
    """A refused call moved no series: an operator could not see load shed or bad input."""
    address = served.servicer.metrics_endpoint.address
    before = scrape(address)
    assert value(before, "kvserve:request_refused_total", code="RESOURCE_EXHAUSTED") == 0   # there from the start
    with grpc.insecure_channel(served.address) as ch:
        stub = pb_grpc.InferenceStub(ch)
        for msg in (request(token_ids=[5000], **greedy(2)), request(token_ids=[5], request_id="a\nb", **greedy(2))):
            with pytest.raises(grpc.RpcError) as err:
                generate(stub, msg)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    after = scrape(address)
    assert value(after, "kvserve:request_refused_total", code="INVALID_ARGUMENT") - \
        value(before, "kvserve:request_refused_total", code="INVALID_ARGUMENT") == 2


def test_inter_token_gaps_are_the_engines_whatever_batches_the_front_takes_them_in():
    """A stream whose front end fell behind takes several events at once: each token after the
    first still counts one gap, of the time between the engine's sends."""
    from types import SimpleNamespace

    from kvserve.model_service.engine.events import Tokens
    from kvserve.model_service.metrics import ServiceMetrics

    metrics = ServiceMetrics(SimpleNamespace(), lambda: None)
    events = [Tokens([5], "a", at=1.0), Tokens([6], "b", at=1.5), Tokens([7, 8], "cd", at=2.5),
              Tokens([9], "e", at=2.75)]
    clock = metrics.stream()
    clock.tokens(events[:1])
    clock.tokens(events[1:])   # three events that piled up, taken together
    samples = {s.name: s.value for s in metrics.itl.collect()[0].samples if not s.labels.get("le")}
    assert samples["kvserve:inter_token_latency_seconds_count"] == 4            # 5 tokens, 4 gaps
    assert samples["kvserve:inter_token_latency_seconds_sum"] == pytest.approx(1.75)   # 0.5 + 0.5 + 0.5 + 0.25


def test_a_request_of_n_sequences_is_one_request_and_each_sequence_has_its_own_gaps(served):
    """Its sequences' tokens come in the same steps: one clock for all of them measured the ~0 s
    between siblings (a mean gap n times too small), and each Finished counted a request."""
    address = served.servicer.metrics_endpoint.address
    before = scrape(address)
    with grpc.insecure_channel(served.address) as ch:
        out = generate(pb_grpc.InferenceStub(ch), request(token_ids=list(range(5, 45)), n=3, temperature=1.0,
                                                          seed=3, max_tokens=10, ignore_eos=True))
    assert out.finished.usage.completion_tokens in (10, 30)   # (the last sequence's, or all of them)
    after = scrape(address)

    def moved(name: str, **labels: str) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    assert moved("kvserve:request_success_total", finished_reason="length") == 1
    for name in ("time_to_first_token_seconds", "e2e_request_latency_seconds", "request_queue_time_seconds",
                 "request_prompt_tokens", "request_generation_tokens", "request_params_n"):
        assert moved(f"kvserve:{name}_count") == 1, name
    assert moved("kvserve:request_prompt_tokens_sum") == 40 and moved("kvserve:request_generation_tokens_sum") == 30
    assert moved("kvserve:inter_token_latency_seconds_count") == 27   # 9 gaps in each of 3 sequences


@pytest.mark.parametrize("how", ["leave", "deadline"])
def test_a_request_its_client_left_counts_as_aborted_as_the_engine_counts_it(served, how):
    """The engine's abort Finished goes to a queue nobody reads any more: /metrics missed every
    disconnect and deadline that GetServerStats counted."""
    from tests.service.util import wait_until
    address = served.servicer.metrics_endpoint.address
    engine = served.servicer.engine
    before, aborted = scrape(address), engine.counters.aborted
    with grpc.insecure_channel(served.address) as ch:
        call = pb_grpc.InferenceStub(ch).Generate(request(token_ids=list(range(5, 25)), max_tokens=1500,
                                                          ignore_eos=True, temperature=0.0),
                                                  timeout=0.5 if how == "deadline" else 60)
        for event in call:
            if event.HasField("chunk"):
                break
        if how == "leave":
            call.cancel()
        else:
            with pytest.raises(grpc.RpcError):
                for _ in call:
                    pass
    wait_until(lambda: engine.counters.aborted == aborted + 1, what="the engine's abort")
    after = scrape(address)

    def moved(name: str, **labels: str) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    assert moved("kvserve:request_success_total", finished_reason="abort") == 1
    # its first token, its time and the tokens it got are counted as a client saw them: those who
    # leave are the latency tail (only finished requests were)
    assert moved("kvserve:time_to_first_token_seconds_count") == 1
    assert moved("kvserve:e2e_request_latency_seconds_count") == 1
    assert moved("kvserve:request_generation_tokens_count") == 1 and moved("kvserve:request_generation_tokens_sum") >= 1
    assert moved("kvserve:request_prompt_tokens_count") == 1 and moved("kvserve:request_prompt_tokens_sum") == 20


def test_time_to_first_token_is_observed_when_it_comes_from_the_calls_arrival():
    """It was observed at the request's end (a long stream's TTFT minutes late), from the request's
    making, after its prompt was tokenized."""
    from types import SimpleNamespace

    from kvserve.model_service.engine.events import Tokens
    from kvserve.model_service.metrics import ServiceMetrics

    metrics = ServiceMetrics(SimpleNamespace(), lambda: None)
    clock = metrics.stream()
    clock.arrival = 10.0
    clock.tokens([Tokens([5], "a", at=10.25)])
    clock.tokens([Tokens([6], "b", at=11.0)])
    samples = {s.name: s.value for s in metrics.ttft.collect()[0].samples if not s.labels.get("le")}
    assert samples["kvserve:time_to_first_token_seconds_count"] == 1
    assert samples["kvserve:time_to_first_token_seconds_sum"] == pytest.approx(0.25)


def test_the_http_fronts_answers_are_counted_its_refusals_too(tiny_dirs):
    """A 400 the front answers before any gRPC call moved no series: an operator saw none of the
    HTTP clients' bad requests."""
    import json
    import urllib.error
    import urllib.request

    server = ModelServerThread(tiny_dirs["tiny"], metrics_listen="127.0.0.1:0", http_listen="127.0.0.1:0")
    try:
        front = f"http://{server.servicer.http_front.address}"

        def post(body: dict) -> int:
            req = urllib.request.Request(f"{front}/v1/completions", json.dumps(body).encode(),
                                         {"Content-Type": "application/json"})
            try:
                with urllib.request.urlopen(req, timeout=30) as response:
                    return response.status
            except urllib.error.HTTPError as err:
                return err.code

        assert post({"prompt": "hello", "max_tokens": -5}) == 400
        assert post({"prompt": "hello", "max_tokens": 2}) == 200
        after = scrape(server.servicer.metrics_endpoint.address)
        assert value(after, "kvserve:http_requests_total", route="/v1/completions", status="400") == 1
        assert value(after, "kvserve:http_requests_total", route="/v1/completions", status="200") == 1
    finally:
        server.stop()


def test_the_served_model_is_a_series_of_its_own(served):
    samples = scrape(served.servicer.metrics_endpoint.address)
    [(labels, one)] = [(dict(labels), v) for (name, labels), v in samples.items() if name == "kvserve:model_info"]
    assert one == 1 and labels["model_name"] == "tiny" and labels["dtype"] == "float32" and labels["device"] == "cpu"
