"""Load a local HF checkpoint directory into CausalLM.

Reads config.json (ModelConfig) and the weights from model.safetensors, or from
the shards that model.safetensors.index.json lists, or from every *.safetensors
in the directory. HF names map to ours with "model." dropped and two fusions:

    layers.i.self_attn.{q,k,v}_proj.{weight,bias} -> layers.i.self_attn.qkv_proj  (cat on dim 0)
    layers.i.mlp.{gate,up}_proj.{weight,bias}     -> layers.i.mlp.gate_up_proj    (cat on dim 0)

A checkpoint without lm_head.weight uses embed_tokens' when config.json ties them
(tie_word_embeddings) and is refused when it does not; one that stores a head of its own keeps
it, tied or not (as transformers does).
The model is built on the meta device and the converted tensors are assigned
to it, so no memory is spent on a random initialisation.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from kvserve.model_service.host_memory import on_huge_pages
from kvserve.model_service.model.config import ModelConfig
from kvserve.model_service import choices
from kvserve.model_service.kernels import rms_norm as rms_norm_kernel
from kvserve.model_service.kernels import rope as rope_kernel
from kvserve.model_service.kernels import decode_layer as decode_layer_kernel
from kvserve.model_service.kernels import small_linear as small_linear_kernel
from kvserve.model_service.kernels.gemm import choose_gemm, widens_bfloat16
from kvserve.model_service.kernels.library import KernelUnavailable
from kvserve.model_service.model.llama import CausalLM
from kvserve.model_service.prompt_tokens import joined_lines

DTYPES = {name: getattr(torch, name) for name in choices.DTYPES}
log = logging.getLogger(__name__)
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)   # buffers some old checkpoints saved


def load_model(path: str | Path, dtype: torch.dtype | str = torch.float32,
               device: torch.device | str = "cpu", gemm: str = "auto",
               small_linear: bool = True) -> tuple[CausalLM, ModelConfig]:
    """gemm: what runs the matmuls on CPU, auto | native | onednn | torch (kernels/gemm.py;
    ValueError if the one named cannot run here). small_linear: on CPU, matmuls of a few rows
    run on the small-batch kernel where it loads (model/linear.py), float32 and bfloat16, and a
    decode step of a few rows runs each layer in one native call (kernels/decode_layer.py)."""
    path = Path(path)
    dtype = parse_dtype(dtype)
    device = torch.device(device)
    gemm = choose_gemm(gemm, dtype, device, plain_kept=small_linear)   # before the weights: a refusal comes at once
    try:   # a config or weights that do not read, or do not fit each other: a sentence, not a trace
        config = _read_config(path)
        hf = read_safetensors(path)
        # Names first (a config of more layers than the checkpoint holds fails at the first
        # missing one, before a module is built for each), then the one width built for real.
        state = map_hf_weights(hf, config)
        _check_head_dim(state, config)
        with torch.device("meta"):
            model = CausalLM(config, device=device, dtype=dtype)
        _check_shapes(state, model)
    except (OSError, SafetensorError, ValueError, MemoryError, torch.OutOfMemoryError) as exc:
        raise ValueError(f"cannot load a model from {path}: {first_line(exc)}") from None
    except RuntimeError as exc:
        if not _out_of_memory(exc):   # a bug: its traceback
            raise
        raise ValueError(f"cannot load a model from {path}: {first_line(exc)}") from None
    # Tied when the checkpoint stores no head, or config.json ties it to an equal one; a head of
    # its own that differs is kept, as transformers keeps it.
    head, embedding = state["lm_head.weight"], state["embed_tokens.weight"]
    tie = head is embedding or (config.tie_word_embeddings and torch.equal(head, embedding))
    if config.tie_word_embeddings and not tie:
        log.warning("config.json ties the LM head to the embedding, but the checkpoint stores a head of its own: "
                    "that one is used, as transformers does")
    try:
        state = {name: t.to(device=device, dtype=dtype) for name, t in state.items()}
    except (RuntimeError, MemoryError) as exc:   # the weights do not fit on the device
        if isinstance(exc, RuntimeError) and not _out_of_memory(exc):
            raise
        raise ValueError(f"cannot load a model from {path} onto {device} as {str(dtype).removeprefix('torch.')}: "
                         f"{first_line(exc)}") from None
    model.load_state_dict(state, strict=True, assign=True)
    if tie:
        model.tie_weights()
    del hf, state   # the model holds the weights now: packing frees each plain one as it goes
    small = None
    if small_linear and device.type == "cpu" and dtype in (torch.float32, torch.bfloat16):
        try:
            small = small_linear_kernel.load()
            model.use_small(small, place=on_huge_pages)   # streamed every decode step
        except KernelUnavailable as exc:
            log.warning("the small-batch linear is unavailable (%s); every matmul runs on %s", exc, gemm)
    if device.type == "cpu":
        model.use_cpu_kernels(_kernel_or_none(rms_norm_kernel.load, "RMSNorm"), _kernel_or_none(rope_kernel.load, "RoPE"))
    if gemm != "torch":
        model.pack(gemm)
    elif widens_bfloat16(gemm, dtype, device):
        model.widen_bfloat16()
    if small is not None:   # reads the plain weights use_small() kept
        model.use_decode_kernel(_kernel_or_none(decode_layer_kernel.load, "fused decode layer"))
    return model.eval(), config


def check_config(path: str | Path) -> None:
    """config.json read and checked alone, first: its error named as load_model names it, before
    the tokenizer (which reads it too) or anything else is loaded."""
    try:
        _read_config(Path(path))
    except (OSError, ValueError) as exc:
        raise ValueError(f"cannot load a model from {path}: {first_line(exc)}") from None


def _read_config(path: Path) -> ModelConfig:
    """config.json as a ModelConfig; ValueError (or OSError) saying what is wrong with it, whatever
    transformers' own checks raise."""
    try:
        return ModelConfig.from_pretrained(path)
    except (OSError, ValueError):
        raise
    except Exception as exc:   # transformers' validation, or a value of the wrong type
        raise ValueError(f"config.json: {type(exc).__name__}: {joined_lines(exc)[:500]}") from None


def _out_of_memory(exc: RuntimeError) -> bool:
    """torch's CPU allocator says it in a RuntimeError (CUDA's is torch.OutOfMemoryError)."""
    return isinstance(exc, torch.OutOfMemoryError) or "can't allocate memory" in str(exc)


def _check_head_dim(state: dict[str, torch.Tensor], config: ModelConfig) -> None:
    """The rotary table is built on the device even when the layers are built on "meta": its width
    is config.json's head_dim, checked against the first layer's q/k/v first (a huge head_dim asked
    the allocator for positions x head_dim / 2 floats, twice, before any shape was compared)."""
    rows = state["layers.0.self_attn.qkv_proj.weight"].shape[0]
    want = (config.num_heads + 2 * config.num_kv_heads) * config.head_dim
    if rows != want:
        raise ValueError(f"layers.0.self_attn.{{q,k,v}}_proj hold {rows} rows together; config.json's "
                         f"{config.num_heads} heads, {config.num_kv_heads} KV heads and head_dim "
                         f"{config.head_dim} make {want}")


def _check_shapes(state: dict[str, torch.Tensor], model: CausalLM) -> None:
    """ValueError naming the first weight whose shape config.json does not make."""
    expected = model.state_dict()
    for name, tensor in state.items():
        want = expected.get(name)
        if want is not None and tuple(tensor.shape) != tuple(want.shape):
            raise ValueError(f"{name} has shape {tuple(tensor.shape)}; config.json makes it {tuple(want.shape)}")


def _kernel_or_none(load, what: str):
    try:
        return load()
    except KernelUnavailable as exc:
        log.warning("the native %s is unavailable (%s); it runs as torch ops", what, exc)
        return None


def parse_dtype(dtype: torch.dtype | str) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        if dtype not in DTYPES.values():
            raise ValueError(f"unsupported dtype {dtype}; supported: {', '.join(DTYPES)}")
        return dtype
    try:
        return DTYPES[dtype]
    except KeyError:
        raise ValueError(f"unsupported dtype {dtype!r}; supported: {', '.join(DTYPES)}") from None


def first_line(exc: BaseException) -> str:
    """An error's message, its first line (transformers' run on with advice for the Hub)."""
    text = str(exc).strip() or type(exc).__name__
    return text.splitlines()[0]




def safetensors_files(path: Path) -> list[Path]:
    """The checkpoint's weight files, as transformers picks them: model.safetensors, else the
    shards its index lists, else every *.safetensors (a stray file beside model.safetensors, a
    stale copy or another layout's consolidated.safetensors, is not read)."""
    single, index = path / "model.safetensors", path / "model.safetensors.index.json"
    if single.is_file():
        return [single]
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            files = sorted(set(weight_map.values()))
            if not all(isinstance(name, str) for name in files):
                raise TypeError
        except (ValueError, KeyError, TypeError, AttributeError):
            raise ValueError(f"{index.name} is not a safetensors index (a JSON object with a weight_map of "
                             "tensor names to files)") from None
        for name in files:   # a shard is a file beside the index, never one elsewhere on the machine
            if not name or Path(name).name != name or name in (".", ".."):
                raise ValueError(f"{index.name} names the shard {name[:200]!r}: shards are files in the "
                                 "checkpoint's directory")
        return [path / name for name in files]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        pickled = " (its pytorch_model*.bin is not read: pickled weights can run code; convert them to " \
                  "safetensors)" if any(path.glob("pytorch_model*.bin")) else ""
        raise FileNotFoundError(f"no *.safetensors in {path}{pickled}")
    return files


def read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint, by HF name, as stored (CPU, checkpoint dtype). A name in
    two files is refused: which one a model should hold is not for the loader to guess."""
    tensors: dict[str, torch.Tensor] = {}
    for file in safetensors_files(path):
        with safe_open(file, framework="pt", device="cpu") as f:
            for name in f.keys():
                if name.endswith(_IGNORED_SUFFIXES):
                    continue
                if name in tensors:
                    raise ValueError(f"tensor {name!r} is in two weight files (the second: {file.name})")
                tensors[name] = f.get_tensor(name)
    return tensors


def map_hf_weights(hf: dict[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
    """HF names -> CausalLM state_dict names, fusing q/k/v and gate/up. Strict both ways."""
    src: dict[str, torch.Tensor] = {}
    for name, t in hf.items():
        short = name.removeprefix("model.")
        if short in src:   # "model.norm.weight" beside "norm.weight": which one is meant is not ours to guess
            raise ValueError(f"checkpoint holds both {short!r} and 'model.{short}'")
        src[short] = t
    used: set[str] = set()

    def take(name: str) -> torch.Tensor:
        if name not in src:
            raise ValueError(f"checkpoint is missing {name!r}")
        used.add(name)
        return src[name]

    def fused(prefix: str, parts: tuple[str, ...], kind: str) -> torch.Tensor:
        tensors = [take(f"{prefix}.{p}.{kind}") for p in parts]
        if len({t.shape[1:] for t in tensors}) > 1:
            raise ValueError(f"{prefix}.{{{','.join(parts)}}}.{kind} have shapes "
                             f"{[tuple(t.shape) for t in tensors]}, which do not fit together")
        if len({t.dtype for t in tensors}) > 1:
            raise ValueError(f"{prefix}.{{{','.join(parts)}}}.{kind} are stored as "
                             f"{[str(t.dtype).removeprefix('torch.') for t in tensors]}, which do not fit together")
        return torch.cat(tensors, dim=0)

    out = {"embed_tokens.weight": take("embed_tokens.weight"), "norm.weight": take("norm.weight")}
    if "lm_head.weight" not in src and not config.tie_word_embeddings:   # transformers would make up a random one
        raise ValueError("checkpoint is missing 'lm_head.weight', and config.json does not tie the head to the "
                         "embedding (tie_word_embeddings is false)")
    out["lm_head.weight"] = take("lm_head.weight") if "lm_head.weight" in src else out["embed_tokens.weight"]
    for i in range(config.num_layers):
        attn, mlp, layer = f"layers.{i}.self_attn", f"layers.{i}.mlp", f"layers.{i}"
        qkv = ("q_proj", "k_proj", "v_proj")
        out[f"{attn}.qkv_proj.weight"] = fused(attn, qkv, "weight")
        if config.qkv_bias:
            out[f"{attn}.qkv_proj.bias"] = fused(attn, qkv, "bias")
        out[f"{attn}.o_proj.weight"] = take(f"{attn}.o_proj.weight")
        if config.o_bias:
            out[f"{attn}.o_proj.bias"] = take(f"{attn}.o_proj.bias")
        if config.qk_norm:
            out[f"{attn}.q_norm.weight"] = take(f"{attn}.q_norm.weight")
            out[f"{attn}.k_norm.weight"] = take(f"{attn}.k_norm.weight")
        out[f"{mlp}.gate_up_proj.weight"] = fused(mlp, ("gate_proj", "up_proj"), "weight")
        out[f"{mlp}.down_proj.weight"] = take(f"{mlp}.down_proj.weight")
        if config.mlp_bias:
            out[f"{mlp}.gate_up_proj.bias"] = fused(mlp, ("gate_proj", "up_proj"), "bias")
            out[f"{mlp}.down_proj.bias"] = take(f"{mlp}.down_proj.bias")
        for norm in ("input_layernorm", "post_attention_layernorm"):
            out[f"{layer}.{norm}.weight"] = take(f"{layer}.{norm}.weight")
    unused = sorted(set(src) - used)
    if unused:
        raise ValueError(f"checkpoint has {len(unused)} tensors this model does not use, "
                         f"e.g. {unused[:5]}")
    return out
