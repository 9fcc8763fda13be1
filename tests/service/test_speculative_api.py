"""Workers started with --speculative ngram behind the gateway: the same greedy tokens as workers
without it, and the drafts counted in the metrics."""

from __future__ import annotations

import urllib.request

from tests.gateway.conftest import make_fleet
from tests.service.conftest import ModelServerThread
from tests.service.util import assert_pages_free, generate, greedy, request

PROMPTS = [[7] * 30, list(range(50, 62)) * 3, list(range(300, 331))]


def test_speculative_workers_behind_the_gateway_give_the_same_tokens(tiny_dirs):
    plain = ModelServerThread(tiny_dirs["tiny"])
    try:
        from kvserve.inference.v1 import inference_pb2_grpc as pb_grpc
        import grpc

        with grpc.insecure_channel(plain.address) as ch:
            expected = [generate(pb_grpc.InferenceStub(ch), request(token_ids=p, **greedy(48))).tokens
                        for p in PROMPTS]
    finally:
        plain.stop()
    config = {"speculative": "ngram", "num_draft_tokens": 4, "metrics_listen": "127.0.0.1:0"}
    for fleet in make_fleet(tiny_dirs["tiny"], 2, worker_config=config):
        got = [generate(fleet.stub, request(token_ids=p, **greedy(48))).tokens for p in PROMPTS]
        assert got == expected
        accepted = 0
        for w in fleet.workers:
            servicer = w.model.servicer
            accepted += servicer.engine.counters.spec_accepted_tokens
            assert_pages_free(servicer)
            text = urllib.request.urlopen(f"http://{servicer.metrics_endpoint.address}/metrics", timeout=10).read()
            assert b"kvserve:spec_decode_num_accepted_tokens_total" in text
        assert accepted > 0
