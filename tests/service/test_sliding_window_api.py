"""A sliding-window model (tiny-mistral, a 64-token window) behind the gateway: a stream well past
the window gives the tokens the worker gives directly, and the pages it let go of are counted in
the worker's metrics."""

from __future__ import annotations

import urllib.request

import grpc

from kvserve.inference.v1 import inference_pb2 as pb
from kvserve.inference.v1 import inference_pb2_grpc as pb_grpc
from tests.gateway.conftest import make_fleet
from tests.service.conftest import ModelServerThread
from tests.service.util import assert_pages_free, generate, greedy, request

PROMPT = list(range(100, 250))   # 150 tokens: past the window before the first output token


def test_past_the_window_through_the_gateway(tiny_dirs):
    direct = ModelServerThread(tiny_dirs["tiny-mistral"])
    try:
        with grpc.insecure_channel(direct.address) as ch:
            expected = generate(pb_grpc.InferenceStub(ch), request(token_ids=PROMPT, **greedy(200))).tokens
    finally:
        direct.stop()
    for fleet in make_fleet(tiny_dirs["tiny-mistral"], 1, worker_config={"metrics_listen": "127.0.0.1:0"}):
        assert generate(fleet.stub, request(token_ids=PROMPT, **greedy(200))).tokens == expected
        servicer = fleet.workers[0].model.servicer
        assert_pages_free(servicer)
        assert servicer.engine.scheduler.slid_pages > 0
        text = urllib.request.urlopen(f"http://{servicer.metrics_endpoint.address}/metrics", timeout=10).read()
        assert b"kvserve:sliding_window_released_pages_total" in text


def test_with_attention_sinks_a_stream_past_its_limit_is_refused_naming_that_limit(tiny_dirs):
    """With sinks a stream may run past the model length; a request past the longest stream is
    refused naming that limit, not the model length (which it may pass)."""
    from kvserve.model_service.request_builder import STREAM_LIMIT

    server = ModelServerThread(tiny_dirs["tiny-mistral"], attention_sink=4)
    try:
        with grpc.insecure_channel(server.address) as ch:
            stub = pb_grpc.InferenceStub(ch)
            try:
                generate(stub, request(token_ids=PROMPT, **greedy(STREAM_LIMIT)))
            except grpc.RpcError as exc:
                assert exc.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert exc.details().endswith(f"exceeds the longest stream with attention sinks {STREAM_LIMIT}")
            else:
                raise AssertionError("a stream past the limit was taken")
            assert len(generate(stub, request(token_ids=PROMPT, **greedy(4))).tokens) == 4
    finally:
        server.stop()


def test_with_attention_sinks_max_tokens_unset_is_still_up_to_the_model_length(tiny_dirs):
    """A stream runs past the model length when its max_tokens asks for it; unset, max_tokens
    means up to the model length as everywhere (it meant 2^24 tokens, so a client that sent none
    got a generation that ran on until it left)."""
    server = ModelServerThread(tiny_dirs["tiny-mistral"], attention_sink=4, max_model_len=200)
    try:
        with grpc.insecure_channel(server.address) as ch:
            stub = pb_grpc.InferenceStub(ch)
            unset = generate(stub, request(token_ids=PROMPT, temperature=0, ignore_eos=True))
            assert len(unset.tokens) == 200 - len(PROMPT)
            assert unset.finished.finish_reason == pb.FINISH_REASON_LENGTH
            past = generate(stub, request(token_ids=PROMPT, **greedy(80)))   # asked for: past the length
            assert len(past.tokens) == 80
    finally:
        server.stop()
