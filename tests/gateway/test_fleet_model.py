"""The fleet's model: a gateway routes nothing to a worker that serves another model than its own
--model (another architecture or vocabulary, or a tokenizer making other ids of the same text),
and says why in its stats; the workers' tokenizer digest is the gateway's for the same files."""

from __future__ import annotations

import json
import shutil

import grpc
import pytest

from kvserve.inference.v1 import inference_pb2 as pb
from kvserve.inference.v1 import inference_pb2_grpc as pb_grpc
from kvserve.model_service.prompt_tokens import load_tokenizer, tokenizer_digest
from kvserve.services.gateway.fleet_model import FleetModel
from tests.gateway.conftest import GatewayThread, WorkerThreads
from tests.service.util import generate, greedy, request, wait_until

LLAMA = FleetModel("LlamaForCausalLM", 1024, "0123456789abcdef", "fedcba9876543210")


def test_a_worker_of_another_architecture_vocabulary_or_tokenizer_serves_another_model():
    same = pb.ModelInfo(name="tiny", architecture="LlamaForCausalLM", vocab_size=1024,
                        tokenizer_digest="0123456789abcdef")
    assert LLAMA.differs(same) is None
    qwen = pb.ModelInfo(name="qwen", architecture="Qwen2ForCausalLM", vocab_size=1024)
    assert "it serves qwen (Qwen2ForCausalLM, a vocabulary of 1024); the gateway's --model is " \
           "LlamaForCausalLM with a vocabulary of 1024" == LLAMA.differs(qwen)
    assert "a vocabulary of 32000" in LLAMA.differs(pb.ModelInfo(architecture="LlamaForCausalLM", vocab_size=32000))
    other_tokenizer = pb.ModelInfo(architecture="LlamaForCausalLM", vocab_size=1024, tokenizer_digest="f" * 16)
    assert "tokenizer makes other ids" in LLAMA.differs(other_tokenizer)
    bigger = pb.ModelInfo(name="wide", architecture="LlamaForCausalLM", vocab_size=1024,
                          tokenizer_digest="0123456789abcdef", config_digest="0" * 16)
    assert LLAMA.differs(bigger).startswith("it serves wide (LlamaForCausalLM, a vocabulary of 1024), of another "
                                            "shape than the gateway's --model")
    # what a worker does not report is not compared (an older version sends no digest)
    assert LLAMA.differs(pb.ModelInfo(architecture="LlamaForCausalLM", vocab_size=1024)) is None
    assert LLAMA.differs(pb.ModelInfo()) is None


def test_one_tokenizer_has_one_digest_and_another_template_or_vocabulary_another(tiny_dirs, tmp_path):
    tiny = tokenizer_digest(load_tokenizer(tiny_dirs["tiny"]))
    assert tiny == tokenizer_digest(load_tokenizer(tiny_dirs["tiny"]))
    assert len(tiny) == 16 and set(tiny) <= set("0123456789abcdef")
    assert tiny == tokenizer_digest(load_tokenizer(tiny_dirs["tiny-mistral"]))   # the same tokenizer files
    assert tiny != tokenizer_digest(load_tokenizer(tiny_dirs["tiny-qwen2"]))
    assert tiny != tokenizer_digest(load_tokenizer(_with_other_template(tiny_dirs["tiny"], tmp_path / "t")))


def test_a_models_shape_has_one_digest_and_its_length_and_special_ids_are_not_in_it(tiny_dirs):
    from kvserve.model_service.model.config import ModelConfig

    tiny = ModelConfig.from_pretrained(tiny_dirs["tiny"])
    same = tiny.replace(max_position_embeddings=8192, max_model_len=8192, eos_token_ids=(7,), bos_token_id=9)
    assert same.digest() == tiny.digest() == ModelConfig.from_pretrained(tiny_dirs["tiny"]).digest()
    for change in (dict(num_layers=tiny.num_layers + 1), dict(intermediate_size=tiny.intermediate_size * 2),
                   dict(rope_theta=tiny.rope_theta * 2), dict(tie_word_embeddings=not tiny.tie_word_embeddings),
                   dict(qk_norm=True)):
        assert tiny.replace(**change).digest() != tiny.digest(), change
    assert ModelConfig.from_pretrained(tiny_dirs["tiny-llama3"]).digest() != tiny.digest()   # its rope scaling


def _with_other_template(source, path):
    """A copy of the checkpoint `source` whose chat template adds one character."""
    shutil.copytree(source, path)
    config = json.loads((path / "tokenizer_config.json").read_text())
    config["chat_template"] = config["chat_template"] + "!"
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return path


def test_the_gateway_routes_only_to_workers_of_its_model_and_says_why_not_the_others(tiny_dirs, tmp_path):
    workers = [WorkerThreads(tiny_dirs["tiny"]), WorkerThreads(tiny_dirs["tiny-qwen2"]),
               WorkerThreads(_with_other_template(tiny_dirs["tiny"], tmp_path / "other-template")),
               WorkerThreads(tiny_dirs["tiny-llama3"])]   # tiny's architecture and tokenizer, its own rope
    ours, qwen, templated, llama3 = (w.address for w in workers)
    gateway = None
    try:
        gateway = GatewayThread([w.address for w in workers], model=str(tiny_dirs["tiny"]))
        with grpc.insecure_channel(gateway.address) as channel:
            stub = pb_grpc.InferenceStub(channel)

            def rows():
                return {w.address: w for w in stub.GetServerStats(pb.GetServerStatsRequest(), timeout=10).workers}

            wait_until(lambda: rows()[qwen].not_serving and rows()[templated].not_serving
                       and rows()[llama3].not_serving and rows()[ours].state == "serving")
            assert rows()[ours].not_serving == ""
            assert rows()[qwen].state == "not serving"
            assert rows()[qwen].not_serving.startswith("another model: it serves tiny-qwen2 (Qwen2ForCausalLM")
            assert "tokenizer makes other ids" in rows()[templated].not_serving
            assert "of another shape than the gateway's --model" in rows()[llama3].not_serving
            for i in range(6):   # every request to the one worker of the gateway's model
                out = generate(stub, request(token_ids=[5 + i, 6, 7, 8, 9], request_id=f"g{i}", **greedy(4)))
                assert len(out.tokens) == 4 and out.finished.finish_reason == pb.FINISH_REASON_LENGTH
            assert {a: w.requests_routed for a, w in rows().items()} == {ours: 6, qwen: 0, templated: 0, llama3: 0}
            info = stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=10)
            assert info.tokenizer_digest == gateway.fleet.model.tokenizer_digest
            assert info.config_digest == gateway.fleet.model.config_digest
    finally:
        if gateway is not None:
            gateway.stop()
        for w in workers:
            w.stop()


def test_a_request_no_worker_of_the_model_takes_is_told_why_when_it_gives_up(tiny_dirs):
    worker = WorkerThreads(tiny_dirs["tiny-qwen2"])
    gateway = None
    try:
        gateway = GatewayThread([worker.address], model=str(tiny_dirs["tiny"]), no_worker_timeout_s=0.5)
        wait_until(lambda: gateway.fleet.workers[worker.address].not_serving)
        with grpc.insecure_channel(gateway.address) as channel:
            stub = pb_grpc.InferenceStub(channel)
            with pytest.raises(grpc.RpcError) as info:
                generate(stub, request(token_ids=[5, 6, 7], **greedy(2)))
            stats = stub.GetServerStats(pb.GetServerStatsRequest(), timeout=10)
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        # the workers' reasons, not their addresses (the log's, not a client's)
        assert "--no-worker-timeout); try again later; 1 worker: another model: it serves tiny-qwen2" in \
            info.value.details() and worker.address not in info.value.details()
        assert stats.not_serving.startswith(f"no worker is serving; {worker.address}: another model")
    finally:
        if gateway is not None:
            gateway.stop()
        worker.stop()
