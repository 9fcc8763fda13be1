"""A tokenizer with more tokens than the model's vocabulary (a fine-tune that added tokens and
did not resize the embeddings): a prompt that uses one is refused as that request's fault. Its
embedding lookup failed the whole engine step, ending every request in flight with INTERNAL."""

from __future__ import annotations

import threading

import grpc

from kvserve.inference.v1 import inference_pb2_grpc as pb_grpc
from kvserve.model_service.tiny_model import make_tiny_model
from kvserve.model_service.tiny_tokenizer import write_tokenizer
from tests.service.conftest import ModelServerThread
from tests.service.util import generate, greedy, request


def test_a_prompt_past_the_models_vocabulary_is_refused_and_others_go_on(tmp_path):
    path = make_tiny_model(tmp_path / "m", "llama", vocab_size=600)
    write_tokenizer(path, 1024, 2048)   # ids 600..1023 exist in the tokenizer only
    server = ModelServerThread(path, page_size=4)
    try:
        with grpc.insecure_channel(server.address) as ch:
            stub = pb_grpc.InferenceStub(ch)
            innocent = stub.Generate(request(token_ids=[10, 20, 30, 40], **greedy(300)), timeout=60)
            first = next(innocent)
            received: list = []
            reader = threading.Thread(target=lambda: received.extend(innocent))
            reader.start()
            try:
                generate(stub, request(prompt="the university of the world cluster decode", **greedy(4)))
            except grpc.RpcError as exc:
                assert exc.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert "is past the model's vocabulary [0, 600): its tokenizer has 1024 tokens" in exc.details()
            else:
                raise AssertionError("a prompt past the vocabulary was taken")
            reader.join(60)
            assert first.HasField("prefill_done") and received[-1].finished.usage.completion_tokens == 300
            assert len(generate(stub, request(prompt="the", **greedy(2))).tokens) == 2   # within it: served
    finally:
        server.stop()
