"""Generated HF checkpoints with random weights, for tests, demos and benchmarks.

`make_tiny_model(dir, arch, **overrides)` writes a real checkpoint directory —
config.json, model.safetensors (HF tensor names), tokenizer.json and
tokenizer_config.json with a chat template — that transformers'
AutoModelForCausalLM / AutoTokenizer and our loader both load.

Weights come from a seeded torch.Generator. Matrices are drawn with std
2/sqrt(fan_in), norm weights around 1 and biases around 0: with HF's default
initializer_range (0.02) the logits would be nearly flat and greedy ties common
(docs/architecture.md, "The equality oracle"). config.json uses the long-standing keys (rope_theta,
rope_scaling) that transformers 4.x and 5 both read.

`default_tiny_path(preset)` builds a preset once per machine into the user
cache dir and returns it; see its docstring for the concurrency rule.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from kvserve.model_service.user_cache import user_cache_dir

# Bump whenever the files a preset produces change, so that cached copies are rebuilt.
GENERATOR_VERSION = 1

_ARCHS = {
    "llama": {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
              "attention_bias": False, "mlp_bias": False},
    "qwen2": {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2",
              "use_sliding_window": False, "sliding_window": None},
    "qwen3": {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3",
              "attention_bias": False, "use_sliding_window": False, "sliding_window": None},
    "mistral": {"architectures": ["MistralForCausalLM"], "model_type": "mistral",
                "sliding_window": None},
}
_TINY = {
    "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "intermediate_size": 128, "vocab_size": 1024, "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": False,
}
# name -> (arch, overrides of _TINY, seed)
PRESETS: dict[str, tuple[str, dict[str, Any], int]] = {
    "tiny": ("llama", {}, 0),
    "tiny-qwen2": ("qwen2", {"tie_word_embeddings": True}, 0),             # q/k/v bias, tied head
    "tiny-qwen3": ("qwen3", {"head_dim": 32}, 0),                          # q/k norm, head_dim != 64/4
    "tiny-mistral": ("mistral", {"sliding_window": 64}, 0),                # served past its window
    "tiny-llama3": ("llama", {"rope_scaling": {                            # + Llama's bias flags
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 256}, "attention_bias": True, "mlp_bias": True}, 0),
    "bench": ("llama", {"hidden_size": 512, "num_hidden_layers": 8, "num_attention_heads": 8,
                        "num_key_value_heads": 2, "head_dim": 64, "intermediate_size": 1536,
                        "vocab_size": 32000, "max_position_embeddings": 4096}, 0),
    # ~1.1B parameters in bfloat16 (2.2 GB written): the GPU benchmark's larger model.
    "bench-1b": ("llama", {"hidden_size": 2048, "num_hidden_layers": 16, "num_attention_heads": 32,
                           "num_key_value_heads": 8, "head_dim": 64, "intermediate_size": 8192,
                           "vocab_size": 32000, "max_position_embeddings": 4096,
                           "torch_dtype": "bfloat16"}, 0),
}


def make_tiny_model(path: str | Path, arch: str = "llama", *, seed: int = 0, **overrides: Any) -> Path:
    """Write a checkpoint directory at `path` (created if missing); -> path.

    overrides are config.json fields over the `tiny` shape (hidden 64, 2 layers,
    4 heads, 2 KV heads, intermediate 128, vocab 1024, max position 2048).
    """
    import torch
    from safetensors.torch import save_file

    from kvserve.model_service.tiny_tokenizer import END_OF_TURN, write_tokenizer

    if arch not in _ARCHS:
        raise ValueError(f"unknown arch {arch!r}; choose from {', '.join(_ARCHS)}")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    config = {**_ARCHS[arch], **_TINY, "hidden_act": "silu", "torch_dtype": "float32", **overrides}
    config.setdefault("head_dim", config["hidden_size"] // config["num_attention_heads"])
    style = "qwen" if arch.startswith("qwen") else "gpt2"
    special = write_tokenizer(path, config["vocab_size"], config["max_position_embeddings"], style=style)
    config.update(bos_token_id=special["<s>"], pad_token_id=special["<pad>"],
                  eos_token_id=[special["</s>"], special[END_OF_TURN]])
    (path / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    generator = torch.Generator().manual_seed(seed)
    dtype = getattr(torch, config["torch_dtype"])   # drawn in float32, stored as the config says
    weights = {name: t.to(dtype) for name, t in random_weights(config, generator).items()}
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    return path


def make_preset(path: str | Path, preset: str = "tiny", seed: int | None = None) -> Path:
    arch, overrides, default_seed = _preset(preset)
    return make_tiny_model(path, arch, seed=default_seed if seed is None else seed, **overrides)


def random_weights(config: dict[str, Any], generator: Any) -> dict[str, Any]:
    """HF-named tensors for `config`, drawn in a fixed order from `generator`."""
    import torch

    def matrix(rows: int, cols: int) -> torch.Tensor:   # (out, in), std 2/sqrt(fan_in)
        return torch.randn(rows, cols, generator=generator) * (2.0 / math.sqrt(cols))

    def norm(size: int) -> torch.Tensor:
        return 1.0 + 0.1 * torch.randn(size, generator=generator)

    def bias(size: int) -> torch.Tensor:
        return 0.5 * torch.randn(size, generator=generator)

    hidden, inter, vocab = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    d = config["head_dim"]
    q, kv = config["num_attention_heads"] * d, config["num_key_value_heads"] * d
    qwen2 = config["model_type"] == "qwen2"
    qkv_bias = qwen2 or config.get("attention_bias", False)
    o_bias = not qwen2 and config.get("attention_bias", False)
    mlp_bias = config.get("mlp_bias", False)
    w = {"model.embed_tokens.weight": torch.randn(vocab, hidden, generator=generator)}
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}"
        for name, rows in (("q_proj", q), ("k_proj", kv), ("v_proj", kv)):
            w[f"{p}.self_attn.{name}.weight"] = matrix(rows, hidden)
            if qkv_bias:
                w[f"{p}.self_attn.{name}.bias"] = bias(rows)
        w[f"{p}.self_attn.o_proj.weight"] = matrix(hidden, q)
        if o_bias:
            w[f"{p}.self_attn.o_proj.bias"] = bias(hidden)
        if config["model_type"] == "qwen3":
            w[f"{p}.self_attn.q_norm.weight"] = norm(d)
            w[f"{p}.self_attn.k_norm.weight"] = norm(d)
        for name, rows, cols in (("gate_proj", inter, hidden), ("up_proj", inter, hidden),
                                 ("down_proj", hidden, inter)):
            w[f"{p}.mlp.{name}.weight"] = matrix(rows, cols)
            if mlp_bias:
                w[f"{p}.mlp.{name}.bias"] = bias(rows)
        w[f"{p}.input_layernorm.weight"] = norm(hidden)
        w[f"{p}.post_attention_layernorm.weight"] = norm(hidden)
    w["model.norm.weight"] = norm(hidden)
    if not config["tie_word_embeddings"]:
        w["lm_head.weight"] = matrix(vocab, hidden)
    return w


def cache_root() -> Path:
    """$XDG_CACHE_HOME/kvserve/models, or ~/.cache/kvserve/models."""
    return user_cache_dir("models")


def default_tiny_path(preset: str = "tiny") -> Path:
    """The preset's checkpoint in the user cache dir, generated on first use.

    The directory name carries a hash of GENERATOR_VERSION and the preset, so a
    changed generator never serves stale files. A build goes to a private temp
    dir beside the final one and is renamed into place in one step: readers see
    no directory or a complete one. When several processes build at once, the
    first rename wins and the others discard their copy.
    """
    arch, overrides, seed = _preset(preset)
    key = json.dumps([GENERATOR_VERSION, preset, arch, overrides, seed], sort_keys=True)
    final = cache_root() / f"{preset}-{hashlib.sha256(key.encode()).hexdigest()[:12]}"
    if (final / "config.json").is_file():
        return final
    tmp = None
    try:
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=final.parent))
        make_preset(tmp, preset)
        try:
            os.rename(tmp, final)
        except OSError:
            if not (final / "config.json").is_file():   # not a lost race: a real error
                raise
    except OSError as exc:   # a full disk, a read-only home: one line, not a traceback
        raise ValueError(f"could not write the built-in model {preset!r} under {final.parent}: "
                         f"{exc.strerror or exc}; free space there or set XDG_CACHE_HOME to a writable "
                         "directory") from exc
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    return final


def _preset(name: str) -> tuple[str, dict[str, Any], int]:
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown preset {name!r}; choose from {', '.join(PRESETS)}") from None
