"""The gateway's /metrics: per worker what it was sent and what its cache saved, worker states,
the queue."""

from __future__ import annotations

import random

import grpc
import pytest

from tests.gateway.conftest import make_fleet
from tests.metrics.scrape import scrape, value
from tests.metrics.test_documented_series import check_each_server
from tests.service.util import generate, greedy, request


def test_routed_requests_and_hit_tokens_per_worker(tiny_dirs):
    for fleet in make_fleet(tiny_dirs["tiny"], 2, worker_config={"metrics_listen": "127.0.0.1:0"},
                            metrics_listen="127.0.0.1:0"):
        check_each_server(fleet)   # the series docs/architecture.md lists, and only those
        address = fleet.gateway.gateway.metrics_endpoint.address
        rng = random.Random(8)
        prompt = [rng.randrange(3, 1024) for _ in range(48)]
        outs = [generate(fleet.stub, request(token_ids=prompt, **greedy(4))) for _ in range(3)]
        samples = scrape(address)
        workers = [w.address for w in fleet.workers]
        routed = {w: value(samples, "kvserve:gateway_routed_requests_total", worker=w) for w in workers}
        hits = {w: value(samples, "kvserve:gateway_hit_tokens_total", worker=w) for w in workers}
        assert sum(routed.values()) == 3
        assert sum(hits.values()) == sum(o.prefill.cached_tokens for o in outs) > 0
        assert sum(value(samples, "kvserve:gateway_prompt_tokens_total", worker=w) for w in workers) == 3 * 48
        for w in workers:
            assert value(samples, "kvserve:gateway_worker_state", worker=w, state="serving") == 1
            assert value(samples, "kvserve:gateway_worker_state", worker=w, state="down") == 0
        assert value(samples, "kvserve:gateway_queue_length") == 0
        assert value(samples, "kvserve:gateway_migrations_total") == 0
        assert value(samples, "kvserve:gateway_generation_tokens_total") == sum(len(o.tokens) for o in outs) == 12
        assert value(samples, "kvserve:gateway_queue_wait_seconds_count") == 3   # each found room at once
        assert value(samples, "kvserve:gateway_queue_wait_seconds_sum") == 0
        # a request every worker refuses (a token outside the vocabulary) was sent, but nobody
        # prefilled its prompt: the prompt tokens (the hit rate's denominator) leave it out
        with pytest.raises(grpc.RpcError) as err:
            generate(fleet.stub, request(token_ids=prompt[:20] + [5000], **greedy(2)))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        after = scrape(address)
        assert sum(value(after, "kvserve:gateway_prompt_tokens_total", worker=w) for w in workers) == 3 * 48
        assert sum(value(after, "kvserve:gateway_routed_requests_total", worker=w) for w in workers) == 4
        # the streams that ran, by how they ended; the calls refused before they ran, by code
        assert value(after, "kvserve:gateway_requests_total", outcome="finished") == 3
        assert value(after, "kvserve:gateway_requests_refused_total", code="INVALID_ARGUMENT") == 1   # the workers'
        with pytest.raises(grpc.RpcError):   # the gateway's own refusal, before routing
            generate(fleet.stub, request(token_ids=[1, 2], request_id="a\nb", **greedy(2)))
        again = scrape(address)
        assert value(again, "kvserve:gateway_requests_refused_total", code="INVALID_ARGUMENT") == 2
        assert value(again, "kvserve:gateway_requests_refused_total", code="RESOURCE_EXHAUSTED") == 0
