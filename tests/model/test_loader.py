"""Checkpoint loading: shards, tied heads, strict names, dtypes; rope and norm against HF."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from kvserve.model_service.kv_cache import KVCache
from kvserve.model_service.model.loader import load_model, parse_dtype
from kvserve.model_service.model.rope import RotaryEmbedding, inverse_frequencies
from tests.model.paged import Chunk, PagePool, Sequence, build_batch


def copy_without_weights(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("*.safetensors"))
    return dst


def prompt_logits(model, config, backend, tokens: list[int], dtype=torch.float32) -> torch.Tensor:
    cache = KVCache(config, 32, 4, dtype=dtype)
    batch = build_batch([Chunk(Sequence(tokens), len(tokens))], 0, PagePool(32), 4)
    return model(batch, cache.layers, backend, backend.prepare(batch))[0]


def test_sharded_checkpoint_with_index_loads_the_same_model(tiny_dirs, tmp_path, backend) -> None:
    src = tiny_dirs["tiny"]
    tensors = load_file(src / "model.safetensors")
    names = sorted(tensors)
    dst = copy_without_weights(src, tmp_path / "sharded")
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for file, part in shards.items():
        save_file({n: tensors[n] for n in part}, dst / file, metadata={"format": "pt"})
    index = {"metadata": {}, "weight_map": {n: f for f, part in shards.items() for n in part}}
    (dst / "model.safetensors.index.json").write_text(json.dumps(index))

    whole, config = load_model(src, gemm="torch")   # unpacked: every weight is in the state_dict
    sharded, _ = load_model(dst, gemm="torch")
    for (name, a), (_, b) in zip(whole.state_dict().items(), sharded.state_dict().items(), strict=True):
        assert torch.equal(a, b), name


def test_tied_head_shares_the_embedding(tiny_dirs) -> None:
    model, config = load_model(tiny_dirs["tiny-qwen2"], gemm="torch")
    assert config.tie_word_embeddings
    assert model.lm_head.weight is model.embed_tokens.weight


def test_a_missing_lm_head_is_the_embedding_only_when_config_json_ties_them(tiny_dirs, tmp_path) -> None:
    """Untied and missing, the head was the embedding without a word (transformers makes up a
    random one and says it is MISSING): refused."""
    tensors = load_file(tiny_dirs["tiny"] / "model.safetensors")
    del tensors["lm_head.weight"]
    tied = _checkpoint(tiny_dirs["tiny"], tmp_path / "tied", tensors, tie_word_embeddings=True)
    model, _ = load_model(tied, gemm="torch")
    assert model.lm_head.weight is model.embed_tokens.weight
    untied = _checkpoint(tiny_dirs["tiny"], tmp_path / "untied", tensors, tie_word_embeddings=False)
    with pytest.raises(ValueError, match="missing 'lm_head.weight', and config.json does not tie the head"):
        load_model(untied, gemm="torch")


@pytest.mark.parametrize("change", ["missing", "extra"])
def test_checkpoint_names_are_strict(tiny_dirs, tmp_path, change: str) -> None:
    tensors = load_file(tiny_dirs["tiny"] / "model.safetensors")
    if change == "missing":
        del tensors["model.layers.1.mlp.up_proj.weight"]
    else:
        tensors["model.layers.0.self_attn.mystery.weight"] = torch.zeros(2)
    dst = copy_without_weights(tiny_dirs["tiny"], tmp_path / change)
    save_file(tensors, dst / "model.safetensors")
    with pytest.raises(ValueError, match="up_proj" if change == "missing" else "mystery"):
        load_model(dst)


def test_no_weights_is_a_clear_error(tiny_dirs, tmp_path) -> None:
    with pytest.raises(ValueError, match=r"cannot load a model from .*empty: no \*\.safetensors in"):
        load_model(copy_without_weights(tiny_dirs["tiny"], tmp_path / "empty"))
    pickled = copy_without_weights(tiny_dirs["tiny"], tmp_path / "pickled")
    (pickled / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(ValueError, match=r"its pytorch_model\*\.bin is not read: .* convert them to safetensors"):
        load_model(pickled)


def test_swish_is_silu(tiny_dirs, tmp_path) -> None:
    """transformers runs hidden_act 'swish' as SiLU; it was refused."""
    _, config = load_model(_checkpoint(tiny_dirs["tiny"], tmp_path / "swish", hidden_act="swish"), gemm="torch")
    assert config.architecture == "LlamaForCausalLM"


def test_dtype_names() -> None:
    assert parse_dtype("bfloat16") is torch.bfloat16 and parse_dtype(torch.float16) is torch.float16
    with pytest.raises(ValueError, match="float32, bfloat16, float16"):
        parse_dtype("int8")


@pytest.mark.parametrize("name", ["tiny", "tiny-qwen3"])
def test_bfloat16_matches_transformers_in_bfloat16(tiny_dirs, backend, name: str) -> None:
    from transformers import AutoModelForCausalLM

    model, config = load_model(tiny_dirs[name], "bfloat16")
    assert model.embed_tokens.weight.dtype == model.rope.cos.dtype == torch.bfloat16
    hf = AutoModelForCausalLM.from_pretrained(tiny_dirs[name], dtype=torch.bfloat16)
    tokens = list(range(7, 47))
    with torch.no_grad():
        expected = hf(torch.tensor([tokens])).logits[0, -1].float()
    ours = prompt_logits(model, config, backend, tokens, torch.bfloat16)
    # Observed equal to the bit on CPU; bf16 leaves room for a different GEMM blocking.
    torch.testing.assert_close(ours, expected, rtol=2e-2, atol=5e-2)


@pytest.mark.parametrize("name", ["tiny", "tiny-qwen3", "tiny-llama3"])
def test_rope_tables_equal_transformers_bit_for_bit(load_pair, name: str) -> None:
    loaded = load_pair(name)
    rotary = loaded.hf.model.rotary_emb
    torch.testing.assert_close(inverse_frequencies(loaded.config), rotary.inv_freq, rtol=0, atol=0)
    positions = torch.arange(0, 2048, 7)
    ours = RotaryEmbedding(loaded.config, 2048)
    cos, sin = ours.lookup(positions)                                        # (T, 1, D/2)
    hf_cos, hf_sin = rotary(torch.zeros(1, dtype=torch.float32), positions[None])  # (1, T, D)
    half = loaded.config.head_dim // 2
    torch.testing.assert_close(cos[:, 0], hf_cos[0, :, :half], rtol=0, atol=0)
    torch.testing.assert_close(sin[:, 0], hf_sin[0, :, half:], rtol=0, atol=0)


def _checkpoint(src: Path, dst: Path, tensors: dict | None = None, **config) -> Path:
    """A copy of `src` with its config edited and, when given, other tensors."""
    copy_without_weights(src, dst)
    data = json.loads((dst / "config.json").read_text())
    data.update(config)
    (dst / "config.json").write_text(json.dumps(data))
    save_file(tensors if tensors is not None else load_file(src / "model.safetensors"), dst / "model.safetensors")
    return dst


def test_weights_that_do_not_fit_config_json_are_refused_with_a_sentence(tiny_dirs, tmp_path) -> None:
    """load_state_dict's and torch.cat's RuntimeErrors, and transformers' own config checks,
    went up as tracebacks."""
    src = tiny_dirs["tiny"]
    tensors = load_file(src / "model.safetensors")
    q = "model.layers.0.self_attn.q_proj.weight"
    narrow_q = {**tensors, q: tensors[q][:, :60].contiguous()}
    cases = [
        (_checkpoint(src, tmp_path / "vocab", vocab_size=1000), r"embed_tokens.weight has shape \(1024, 64\); "
                                                                  r"config.json makes it \(1000, 64\)"),
        (_checkpoint(src, tmp_path / "q", narrow_q), r"q_proj,k_proj,v_proj\}.weight have shapes .* do not fit"),
        (_checkpoint(src, tmp_path / "mixed", {**tensors, "model.layers.0.mlp.up_proj.weight":
                                               tensors["model.layers.0.mlp.up_proj.weight"].to(torch.float8_e4m3fn)}),
         r"gate_proj,up_proj\}.weight are stored as \['float32', 'float8_e4m3fn'\]"),
        (_checkpoint(src, tmp_path / "eps", rms_norm_eps=0), "config.json: "),
        (_checkpoint(src, tmp_path / "heads", num_attention_heads=0), "config.json: |num_attention_heads"),
    ]
    for path, message in cases:
        with pytest.raises(ValueError, match=f"^cannot load a model from {path}: .*{message}"):
            load_model(path, gemm="torch")


def test_a_stored_head_that_differs_is_kept_even_when_config_json_ties_it(tiny_dirs, tmp_path) -> None:
    """transformers keeps a checkpoint's own head when it differs from the embedding (tied, the
    tokens differed from the first)."""
    src = tiny_dirs["tiny-qwen2"]
    tensors = load_file(src / "model.safetensors")
    head = torch.randn_like(tensors["model.embed_tokens.weight"])
    model, config = load_model(_checkpoint(src, tmp_path / "own-head", {**tensors, "lm_head.weight": head}),
                               gemm="torch")
    assert config.tie_word_embeddings and model.lm_head.weight is not model.embed_tokens.weight
    assert torch.equal(model.lm_head.weight, head)
    same, _ = load_model(_checkpoint(src, tmp_path / "same-head", {
        **tensors, "lm_head.weight": tensors["model.embed_tokens.weight"].clone()}), gemm="torch")
    assert same.lm_head.weight is same.embed_tokens.weight


def test_model_safetensors_is_read_alone_and_a_tensor_in_two_files_is_refused(tiny_dirs, tmp_path) -> None:
    src = tiny_dirs["tiny"]
    tensors = load_file(src / "model.safetensors")
    stray = _checkpoint(src, tmp_path / "stray")
    save_file({"other.weight": torch.zeros(2)}, stray / "consolidated.safetensors")   # another layout's file
    save_file({k: torch.zeros_like(v) for k, v in tensors.items()}, stray / "model_old.safetensors")
    model, _ = load_model(stray, gemm="torch")
    assert torch.equal(model.norm.weight, tensors["model.norm.weight"])
    shards = copy_without_weights(src, tmp_path / "shards")
    save_file(tensors, shards / "a.safetensors")
    save_file({"model.norm.weight": tensors["model.norm.weight"]}, shards / "b.safetensors")
    with pytest.raises(ValueError, match="tensor 'model.norm.weight' is in two weight files"):
        load_model(shards, gemm="torch")
    (shards / "b.safetensors").unlink()
    (shards / "model.safetensors.index.json").write_text("[]")
    with pytest.raises(ValueError, match="is not a safetensors index"):
        load_model(shards, gemm="torch")


def test_the_rope_table_starts_short_whatever_the_configs_length(tiny_dirs, tmp_path) -> None:
    """It was built for max_position_embeddings at load: 2^40 positions could not be allocated."""
    model, config = load_model(_checkpoint(tiny_dirs["tiny"], tmp_path / "long", max_position_embeddings=2**40),
                               gemm="torch")
    assert config.max_model_len == 2**40 and model.rope.cos.shape[0] <= 8192
    model.rope.reserve(10_000)
    assert model.rope.cos.shape[0] == 10_000


def test_hostile_config_and_index_values_are_refused_before_anything_is_built(tiny_dirs, tmp_path) -> None:
    """Each of these was a traceback, a wait of minutes, gigabytes asked of the allocator, a file
    read from elsewhere on the machine, or a reason left out, before it was a sentence."""
    src = tiny_dirs["tiny"]
    tensors = load_file(src / "model.safetensors")
    outside = tmp_path / "outside.safetensors"
    save_file(tensors, outside)
    cases = [
        # a layer built for each of them first (minutes), then the missing weights said
        (_checkpoint(src, tmp_path / "layers", num_hidden_layers=20000), "checkpoint is missing 'layers.2"),
        # the rotary table is built for real: positions x head_dim / 2 floats asked before any shape was compared
        (_checkpoint(src, tmp_path / "head-dim", head_dim=2**24), r"head_dim 16777216 make"),
        # transformers says why on its second line
        (_checkpoint(src, tmp_path / "indivisible", hidden_size=64, num_attention_heads=5,
                     num_key_value_heads=5), "not a multiple of the number of attention heads"),
        # NaN logits, with no word
        (_checkpoint(src, tmp_path / "theta", rope_theta=0), "rope_theta must be a positive number"),
        (_checkpoint(src, tmp_path / "llama3", rope_scaling={
            "rope_type": "llama3", "factor": 0, "low_freq_factor": 1, "high_freq_factor": 4,
            "original_max_position_embeddings": 64}), "llama3 rope scaling needs factor > 0"),
        # transformers reads 'model.norm.weight' and leaves the other: the loader took the other
        (_checkpoint(src, tmp_path / "twice", {**tensors, "norm.weight": torch.zeros_like(tensors["model.norm.weight"])}),
         "checkpoint holds both 'norm.weight' and 'model.norm.weight'"),
    ]
    for shard, words in [(str(outside), "names the shard"), ("../outside.safetensors", "names the shard"),
                         (5, "is not a safetensors index"), (None, "is not a safetensors index")]:
        sharded = copy_without_weights(src, tmp_path / f"index-{len(cases)}")
        (sharded / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
            name: shard for name in tensors}}))
        cases.append((sharded, words))
    for path, message in cases:
        with pytest.raises(ValueError, match=f"^cannot load a model from {path}: .*{message}"):
            load_model(path, gemm="torch")
