"""What a request leaves unset of its sampling takes the checkpoint's generation_config.json (as
vLLM's --generation-config auto does): read, checked, and applied only where the request is silent."""

from __future__ import annotations

import json
import shutil

import grpc
import pytest

from kvserve.inference.v1 import inference_pb2_grpc as pb_grpc
from kvserve.model_service.generation_defaults import GenerationDefaults, load
from tests.service.conftest import ModelServerThread
from tests.service.util import generate, request

QWEN3_LIKE = {"do_sample": True, "temperature": 0.6, "top_p": 0.95, "top_k": 20, "bos_token_id": 1,
              "eos_token_id": [2, 3], "transformers_version": "4.51.0"}


def test_the_checkpoints_recommendation_is_read_and_checked(tmp_path, caplog):
    assert load(tmp_path) == GenerationDefaults()   # no file: plain sampling
    (tmp_path / "generation_config.json").write_text(json.dumps(QWEN3_LIKE))
    assert load(tmp_path) == GenerationDefaults(temperature=0.6, top_p=0.95, top_k=20)
    assert load(tmp_path, "none") == GenerationDefaults()
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"temperature": 0.7, "top_p": 0, "min_p": 2, "repetition_penalty": "high", "top_k": -1}))
    assert load(tmp_path) == GenerationDefaults(temperature=0.7)   # the rest out of range: left out, said
    assert "top_p 0 is out of range" in caplog.text and "min_p 2 is out of range" in caplog.text
    for text in ("{not json", "[1, 2]"):
        (tmp_path / "generation_config.json").write_text(text)
        assert load(tmp_path) == GenerationDefaults()


@pytest.fixture(scope="module")
def recommending(tiny_dirs, tmp_path_factory):
    """The tiny model with a Qwen3-like generation_config.json, served; each submitted request's
    sampling is kept."""
    model = tmp_path_factory.mktemp("recommending") / "tiny"
    shutil.copytree(tiny_dirs["tiny"], model)
    (model / "generation_config.json").write_text(json.dumps(QWEN3_LIKE))
    server = ModelServerThread(model)
    seen = []
    submit = server.servicer.engine.submit
    server.servicer.engine.submit = lambda r, sink: (seen.append(r.params), submit(r, sink))[1]
    try:
        yield server, seen
    finally:
        server.stop()


def test_unset_fields_take_the_models_values_and_set_ones_win(recommending):
    server, seen = recommending
    with grpc.insecure_channel(server.address) as ch:
        stub = pb_grpc.InferenceStub(ch)
        generate(stub, request(token_ids=[5, 6, 7], max_tokens=2))
        generate(stub, request(token_ids=[5, 6, 7], max_tokens=2, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0))
        generate(stub, request(token_ids=[5, 6, 7], max_tokens=2, temperature=0.0))
    unset, plain, greedy = seen[-3:]
    assert (unset.temperature, unset.top_p, unset.top_k, unset.min_p, unset.repetition_penalty) == \
        pytest.approx((0.6, 0.95, 20, 0.0, 1.0))
    assert (plain.temperature, plain.top_p, plain.top_k, plain.min_p) == (1.0, 1.0, 0, 0.0)   # 0 is off, not unset
    assert greedy.temperature == 0.0 and greedy.top_k == 20   # greedy ignores the filters


def test_generation_config_none_leaves_plain_sampling(tiny_dirs, tmp_path):
    model = tmp_path / "tiny"
    shutil.copytree(tiny_dirs["tiny"], model)
    (model / "generation_config.json").write_text(json.dumps(QWEN3_LIKE))
    server = ModelServerThread(model, generation_config="none")
    try:
        assert server.servicer.stack.generation_defaults == GenerationDefaults()
    finally:
        server.stop()
