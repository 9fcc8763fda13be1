"""bench/gpu_bench.py's pieces and bench/trained_model.py on CPU, small: the agreement protocol
finds a backend agreeing with itself exactly and float32 apart from bf16; results merge at every
depth; a decode step's bytes; a trained checkpoint loads in the model service's loader, its
language is the same when drawn again, and training lowers its loss."""

from __future__ import annotations

import json
import random
from types import SimpleNamespace

import torch

from bench.gpu_bench import agreement, merge, step_bytes
from bench.trained_model import Chain, prompts, train


def test_agreement_of_the_torch_backend_with_itself_is_exact(tiny_dirs):
    result = agreement(tiny_dirs["tiny"], torch.device("cpu"), "torch", 3, 16, 40, 4)
    assert result["positions"] == 3 * 5 and result["backend"] == "torch"
    assert result["candidate"]["agree"] == 1.0 and result["candidate"]["max_abs_diff"] == 0.0
    assert result["float32"]["max_abs_diff"] > 0   # bf16 is not float32
    assert 0 < result["torch_vs_float32"]["mean_abs_diff"] == result["float32"]["mean_abs_diff"]


def test_results_merge_at_every_depth(tmp_path):
    path = tmp_path / "r.json"
    merge(path, {"models": {"bench": {"layers": 8, "mean_prompt": {"64": 500}}}})
    merge(path, {"models": {"bench": {"mean_prompt": {"256": 600}}}, "bandwidth": 1.0})
    data = json.loads(path.read_text())
    assert data["models"]["bench"] == {"layers": 8, "mean_prompt": {"64": 500, "256": 600}}
    assert data["bandwidth"] == 1.0


def test_a_decode_step_reads_the_weights_once_and_every_token_of_kv():
    c = SimpleNamespace(hidden_size=2048, num_layers=16, num_heads=32, num_kv_heads=8, head_dim=64,
                        intermediate_size=8192, vocab_size=32000)
    weights, per_token = step_bytes(c)
    assert 2.0e9 < weights < 2.2e9                                # ~1.04B parameters in bf16
    assert 1000 * per_token == 1000 * 2 * 16 * 8 * 64 * 2          # K and V, every layer


def test_the_chain_is_the_same_when_drawn_again_and_stays_in_its_ids():
    a, b = Chain(64, seed=3), Chain(64, seed=3)
    assert a.successors == b.successors
    walk = a.walk(200, random.Random(1))
    assert walk == b.walk(200, random.Random(1))
    assert all(3 <= t < 3 + 64 for t in walk)
    assert all(nxt in a.successors[t] for t, nxt in zip(walk, walk[1:]))


def test_a_trained_checkpoint_loads_and_its_prompts_are_in_its_language(tmp_path):
    from kvserve.model_service.model.loader import load_model

    out = tmp_path / "trained"
    result = train("tiny", out, steps=30, tokens=32, batch=8, length=32, device="cpu")
    assert result["last_loss"] < result["first_loss"]
    model, config = load_model(out, torch.float32, "cpu")
    assert config.vocab_size == 1024
    drawn = prompts(out, 4, 10, 20)
    assert drawn == prompts(out, 4, 10, 20) and all(10 <= len(p) <= 20 for p in drawn)
    chain = Chain(32, json.loads((out / "chain.json").read_text())["seed"])
    assert all(nxt in chain.successors[t] for p in drawn for t, nxt in zip(p, p[1:]))
