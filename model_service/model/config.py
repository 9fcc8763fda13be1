"""ModelConfig: the shape of a Llama-family checkpoint, read from its config.json.

transformers reads the file (AutoConfig, local files only); this module turns
its attributes into one frozen dataclass that the model, the loader, the KV
cache and the engine share, and rejects what the model does not implement with
a ValueError that says what is supported.

Rope parameters: transformers 5 keeps them in `rope_parameters`
({"rope_type", "rope_theta", ...}); 4.x in `rope_theta` and `rope_scaling`
({"rope_type" or "type", ...}). Both are read; the newer wins where both exist.

Sliding window. When every layer slides (Mistral; Qwen2/Qwen3 with use_sliding_window
and every layer marked sliding), `sliding_window` is W: a query at position p attends to
keys p-W+1 .. p (transformers' `kv_idx > q_idx - sliding_window`), the engine releases
pages that fell out of the window while a sequence runs, and the model serves its whole
`max_position_embeddings`. A model whose layers mix sliding and full attention (Qwen2/Qwen3
with max_window_layers) has `sliding_window` None and `layer_windows` per layer: each layer
masks its own way and, the full layers needing every page, no page is released early.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# HF architecture name -> what differs from plain Llama (documentation only; the
# differences themselves are read from the config's fields).
SUPPORTED_ARCHITECTURES: dict[str, str] = {
    "LlamaForCausalLM": "attention_bias and mlp_bias flags",
    "MistralForCausalLM": "sliding window (see module docstring)",
    "Qwen2ForCausalLM": "bias on q/k/v, none on o",
    "Qwen3ForCausalLM": "RMSNorm on q and k per head, explicit head_dim",
}
_ARCH_BY_MODEL_TYPE = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}
SUPPORTED_ROPE_TYPES = ("default", "llama3")


@dataclass(frozen=True, slots=True)
class Llama3RopeScaling:
    """Llama 3.1's frequency-dependent rope scaling (rope_type "llama3")."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclass(frozen=True, slots=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: Llama3RopeScaling | None   # None: plain rope
    qkv_bias: bool                           # bias on q/k/v projections
    o_bias: bool                             # bias on the output projection
    mlp_bias: bool                           # bias on gate/up/down
    qk_norm: bool                            # Qwen3: RMSNorm over head_dim on q and k, before rope
    tie_word_embeddings: bool                # lm_head shares embed_tokens' weight
    max_position_embeddings: int
    sliding_window: int | None
    max_model_len: int                       # longest sequence this model serves (see module docstring)
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    pad_token_id: int | None = None
    layer_windows: tuple[int | None, ...] = ()   # each layer's sliding window (None: full attention)

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads",
                     "head_dim", "intermediate_size", "max_model_len"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of "
                             f"num_kv_heads ({self.num_kv_heads})")
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for rope, got {self.head_dim}")
        if not self.rms_norm_eps > 0:
            raise ValueError(f"rms_norm_eps must be positive, got {self.rms_norm_eps}")
        if any(w is not None and w <= 0 for w in self.layer_windows):
            raise ValueError(f"sliding windows must be positive, got {self.layer_windows}")

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def num_queries_per_kv(self) -> int:
        return self.num_heads // self.num_kv_heads

    @classmethod
    def from_pretrained(cls, path: str | Path) -> ModelConfig:
        """Read `path`/config.json (a local checkpoint directory; never the hub)."""
        from transformers import AutoConfig

        path = Path(path)
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"no config.json in {path} (a local HF checkpoint directory)")
        return cls.from_hf(AutoConfig.from_pretrained(path, local_files_only=True))

    @classmethod
    def from_hf(cls, hf: Any) -> ModelConfig:
        """Build from a transformers PretrainedConfig (or any object with its attributes)."""
        arch = _architecture(hf)
        if getattr(hf, "hidden_act", "silu") not in ("silu", "swish"):   # one function, as transformers' ACT2FN
            raise ValueError(f"only hidden_act 'silu' (or 'swish') is supported, got {hf.hidden_act!r}")
        num_heads = hf.num_attention_heads
        if not isinstance(num_heads, int) or num_heads <= 0:
            raise ValueError(f"num_attention_heads must be a positive integer, got {num_heads!r}")
        head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // num_heads
        theta, scaling = _rope(hf)
        layer_windows = _layer_windows(hf, arch)
        window = layer_windows[0] if layer_windows and len(set(layer_windows)) == 1 else None
        max_pos = hf.max_position_embeddings
        attention_bias = bool(getattr(hf, "attention_bias", False))
        return cls(
            architecture=arch,
            vocab_size=hf.vocab_size,
            hidden_size=hf.hidden_size,
            num_layers=hf.num_hidden_layers,
            num_heads=num_heads,
            num_kv_heads=getattr(hf, "num_key_value_heads", None) or num_heads,
            head_dim=head_dim,
            intermediate_size=hf.intermediate_size,
            rms_norm_eps=float(hf.rms_norm_eps),
            rope_theta=theta,
            rope_scaling=scaling,
            # as transformers reads them: Qwen2's q/k/v always carry a bias, Mistral's nothing does,
            # attention_bias counts for Llama and Qwen3 only and mlp_bias for Llama only
            qkv_bias=arch == "Qwen2ForCausalLM" or (arch in _ATTENTION_BIAS_READ and attention_bias),
            o_bias=arch in _ATTENTION_BIAS_READ and attention_bias,
            mlp_bias=arch == "LlamaForCausalLM" and bool(getattr(hf, "mlp_bias", False)),
            qk_norm=arch == "Qwen3ForCausalLM",
            tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
            max_position_embeddings=max_pos,
            sliding_window=window,
            max_model_len=max_pos,
            layer_windows=layer_windows,
            bos_token_id=getattr(hf, "bos_token_id", None),
            eos_token_ids=_id_tuple(getattr(hf, "eos_token_id", None)),
            pad_token_id=getattr(hf, "pad_token_id", None),
        )

    def replace(self, **changes: Any) -> ModelConfig:
        return dataclasses.replace(self, **changes)

    def digest(self) -> str:
        """16 hex digits of the model's shape and arithmetic (_SHAPE: sizes, layers, heads, rope,
        biases, norms, windows, tying): two checkpoints of one architecture and tokenizer but
        another shape differ here. Not its weights, its length (max_position_embeddings) or its
        special token ids, which a deployment may set apart from the model itself; a field added
        to this class changes no digest unless it joins _SHAPE."""
        shape = {name: getattr(self, name) for name in _SHAPE}
        shape["rope_scaling"] = self.rope_scaling and dataclasses.asdict(self.rope_scaling)
        return hashlib.sha256(json.dumps(shape, sort_keys=True).encode()).hexdigest()[:16]


_ATTENTION_BIAS_READ = ("LlamaForCausalLM", "Qwen3ForCausalLM")
# What ModelConfig.digest names a model's shape by.
_SHAPE = ("architecture", "vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
          "intermediate_size", "rms_norm_eps", "rope_theta", "rope_scaling", "qkv_bias", "o_bias", "mlp_bias",
          "qk_norm", "tie_word_embeddings", "sliding_window", "layer_windows")


def _architecture(hf: Any) -> str:
    archs = list(getattr(hf, "architectures", None) or [])
    if not archs and getattr(hf, "model_type", None) in _ARCH_BY_MODEL_TYPE:
        archs = [_ARCH_BY_MODEL_TYPE[hf.model_type]]
    for arch in archs:
        if arch in SUPPORTED_ARCHITECTURES:
            return arch
    raise ValueError(f"unsupported architecture {archs or getattr(hf, 'model_type', None)!r}; "
                     f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}")


def _rope(hf: Any) -> tuple[float, Llama3RopeScaling | None]:
    params: dict[str, Any] = {}
    params.update(getattr(hf, "rope_scaling", None) or {})     # transformers 4.x
    params.update(getattr(hf, "rope_parameters", None) or {})  # transformers 5
    theta = params.get("rope_theta", getattr(hf, "rope_theta", None))
    theta = 10000.0 if theta is None else float(theta)
    if not 0 < theta < math.inf:   # 0 made every frequency infinite: NaN logits, with no word
        raise ValueError(f"rope_theta must be a positive number, got {theta}")
    rope_type = params.get("rope_type", params.get("type", "default"))
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError("partial_rotary_factor other than 1.0 is not supported")
    if rope_type == "default":
        return theta, None
    if rope_type == "llama3":
        try:
            scaling = Llama3RopeScaling(
                factor=float(params["factor"]),
                low_freq_factor=float(params["low_freq_factor"]),
                high_freq_factor=float(params["high_freq_factor"]),
                # a top-level original_max_position_embeddings wins over the scaling's, as in
                # transformers (its standardize_rope_params)
                original_max_position_embeddings=int(getattr(hf, "original_max_position_embeddings", None)
                                                     or params["original_max_position_embeddings"]),
            )
        except KeyError as exc:
            raise ValueError(f"llama3 rope scaling is missing {exc.args[0]!r}") from None
        # (each divides a frequency or a wavelength: a zero made NaN logits)
        if not (0 < scaling.factor < math.inf and 0 < scaling.low_freq_factor < scaling.high_freq_factor < math.inf
                and scaling.original_max_position_embeddings > 0):
            raise ValueError(f"llama3 rope scaling needs factor > 0, 0 < low_freq_factor < high_freq_factor and "
                             f"original_max_position_embeddings > 0, got {scaling}")
        return theta, scaling
    raise ValueError(f"unsupported rope type {rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}")


def _layer_windows(hf: Any, arch: str) -> tuple[int | None, ...]:
    """Each layer's sliding window, or () when no layer slides."""
    window = getattr(hf, "sliding_window", None)
    if not window:
        return ()
    if not isinstance(window, int) or window < 0:
        raise ValueError(f"sliding_window must be a positive integer (or null), got {window!r}")
    if arch == "MistralForCausalLM":
        return (int(window),) * hf.num_hidden_layers
    # Qwen2/Qwen3 declare a window but use it only on layers marked sliding.
    layer_types = getattr(hf, "layer_types", None) or []
    if getattr(hf, "use_sliding_window", False) and "sliding_attention" in layer_types:
        return tuple(int(window) if t == "sliding_attention" else None for t in layer_types)
    return ()


def _id_tuple(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)
