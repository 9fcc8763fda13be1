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
