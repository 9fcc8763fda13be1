"""ModelConfig from config.json: fields per architecture, rope formats, clear rejections."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from transformers import LlamaConfig

from kvserve.model_service.model.config import Llama3RopeScaling, ModelConfig


def test_fields_of_each_tiny_architecture(tiny_dirs: dict[str, Path]) -> None:
    llama = ModelConfig.from_pretrained(tiny_dirs["tiny"])
    assert (llama.architecture, llama.hidden_size, llama.num_layers) == ("LlamaForCausalLM", 64, 2)
    assert (llama.num_heads, llama.num_kv_heads, llama.head_dim) == (4, 2, 16)
    assert (llama.qkv_bias, llama.o_bias, llama.mlp_bias, llama.qk_norm) == (False, False, False, False)
    assert llama.rope_scaling is None and llama.rope_theta == 10000.0
    assert (llama.max_model_len, llama.sliding_window) == (2048, None)
    assert (llama.bos_token_id, llama.eos_token_ids, llama.pad_token_id) == (1, (2, 6), 0)

    qwen2 = ModelConfig.from_pretrained(tiny_dirs["tiny-qwen2"])
    assert (qwen2.qkv_bias, qwen2.o_bias, qwen2.tie_word_embeddings) == (True, False, True)

    qwen3 = ModelConfig.from_pretrained(tiny_dirs["tiny-qwen3"])
    assert qwen3.qk_norm and qwen3.head_dim == 32 and qwen3.q_size == 128

    mistral = ModelConfig.from_pretrained(tiny_dirs["tiny-mistral"])
    assert (mistral.sliding_window, mistral.max_model_len) == (64, 2048)   # served past the window

    llama3 = ModelConfig.from_pretrained(tiny_dirs["tiny-llama3"])
    assert llama3.rope_scaling == Llama3RopeScaling(8.0, 1.0, 4.0, 256)
    assert (llama3.qkv_bias, llama3.o_bias, llama3.mlp_bias) == (True, True, True)


def test_windows_per_layer(tiny_dirs: dict[str, Path], tmp_path: Path) -> None:
    mixed = edit_config(tiny_dirs["tiny-qwen2"], tmp_path / "mixed", use_sliding_window=True, sliding_window=32,
                        layer_types=["full_attention", "sliding_attention"], max_window_layers=1)
    cfg = ModelConfig.from_pretrained(mixed)
    assert (cfg.sliding_window, cfg.layer_windows, cfg.max_model_len) == (None, (None, 32), cfg.max_position_embeddings)
    every = edit_config(tiny_dirs["tiny-qwen2"], tmp_path / "every", use_sliding_window=True, sliding_window=32,
                        layer_types=["sliding_attention", "sliding_attention"], max_window_layers=0)
    cfg = ModelConfig.from_pretrained(every)
    assert (cfg.sliding_window, cfg.max_model_len) == (32, cfg.max_position_embeddings)


def test_rope_parameters_and_legacy_keys_agree() -> None:
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 256}
    hf = LlamaConfig(hidden_size=64, num_attention_heads=4, rope_theta=5e5, rope_scaling=scaling,
                     architectures=["LlamaForCausalLM"])
    cfg = ModelConfig.from_hf(hf)           # transformers 5 moved these into rope_parameters
    assert cfg.rope_theta == 5e5 and cfg.rope_scaling.factor == 8.0

    class Legacy:                            # a transformers 4.x style object
        architectures = ["LlamaForCausalLM"]
        vocab_size, hidden_size, num_hidden_layers, intermediate_size = 32, 64, 1, 128
        num_attention_heads, num_key_value_heads, rms_norm_eps = 4, 4, 1e-5
        max_position_embeddings = 128
        rope_theta = 5e5
        rope_scaling = {**{k: v for k, v in scaling.items() if k != "rope_type"}, "type": "llama3"}

    legacy = ModelConfig.from_hf(Legacy())
    assert (legacy.rope_theta, legacy.rope_scaling) == (cfg.rope_theta, cfg.rope_scaling)


def edit_config(src: Path, dst: Path, **changes) -> Path:
    dst.mkdir()
    data = json.loads((src / "config.json").read_text())
    data.update(changes)
    (dst / "config.json").write_text(json.dumps(data))
    return dst


def test_unsupported_architecture_names_the_supported_ones(tiny_dirs, tmp_path: Path) -> None:
    path = edit_config(tiny_dirs["tiny"], tmp_path / "gpt", architectures=["GPT2LMHeadModel"],
                       model_type="llama")
    with pytest.raises(ValueError, match="LlamaForCausalLM.*Qwen3ForCausalLM"):
        ModelConfig.from_pretrained(path)


def test_unsupported_rope_type_is_rejected(tiny_dirs, tmp_path: Path) -> None:
    path = edit_config(tiny_dirs["tiny"], tmp_path / "yarn",
                       rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                     "original_max_position_embeddings": 256})
    with pytest.raises(ValueError, match="rope type 'yarn'.*default, llama3"):
        ModelConfig.from_pretrained(path)


def test_missing_directory_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="config.json"):
        ModelConfig.from_pretrained(tmp_path / "nothing")


def test_shape_validation() -> None:
    hf = LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=3,
                     architectures=["LlamaForCausalLM"])
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        ModelConfig.from_hf(hf)


def test_bias_flags_count_where_transformers_reads_them(tiny_dirs, tmp_path: Path) -> None:
    """Mistral's layers carry no bias and Qwen2/Qwen3's MLP none, whatever the flags say (a
    checkpoint transformers served was refused for bias tensors it does not have)."""
    for name, flag, fields in [("tiny-mistral", "attention_bias", ("qkv_bias", "o_bias")),
                               ("tiny-mistral", "mlp_bias", ("mlp_bias",)), ("tiny-qwen2", "mlp_bias", ("mlp_bias",)),
                               ("tiny-qwen3", "mlp_bias", ("mlp_bias",))]:
        cfg = ModelConfig.from_pretrained(edit_config(tiny_dirs[name], tmp_path / f"{name}-{flag}", **{flag: True}))
        assert not any(getattr(cfg, f) for f in fields), (name, flag)
    qwen3 = ModelConfig.from_pretrained(edit_config(tiny_dirs["tiny-qwen3"], tmp_path / "q3", attention_bias=True))
    assert qwen3.qkv_bias and qwen3.o_bias   # Qwen3 reads attention_bias, as Llama does


def test_a_top_level_original_length_wins_over_the_llama3_scalings(tiny_dirs, tmp_path: Path) -> None:
    """As transformers' standardize_rope_params has it (the table differed at position 0)."""
    path = edit_config(tiny_dirs["tiny-llama3"], tmp_path / "orig", original_max_position_embeddings=16)
    assert ModelConfig.from_pretrained(path).rope_scaling.original_max_position_embeddings == 16


@pytest.mark.parametrize("window", [-3, -4096])
def test_a_window_that_is_not_a_positive_integer_is_refused(tiny_dirs, tmp_path: Path, window) -> None:
    path = edit_config(tiny_dirs["tiny-mistral"], tmp_path / "w", sliding_window=window)
    with pytest.raises(ValueError, match="sliding_window must be a positive integer"):
        ModelConfig.from_pretrained(path)
