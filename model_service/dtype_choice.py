"""`--dtype auto`: which dtype the weights and KV pages take; `--kv-cache-dtype`: the pages' own.

- CUDA: bfloat16.
- CPU: the checkpoint's own dtype where the CPU computes it natively, else float32. A bfloat16
  checkpoint (most published Llama and Qwen weights) runs in bfloat16 on a CPU with AVX512-BF16
  or AMX, where oneDNN's bfloat16 GEMMs run on the CPU's own instructions; there it measured
  faster than float32 in both phases (half the bytes per decode step, and prefill on native
  bf16 dot products; docs/benchmarks.md, "Single stream"). Without them oneDNN refuses
  bfloat16, and its matmuls run on F.linear, widened to float32 from a few rows up
  (model/linear.py): there bfloat16 decodes one request faster than float32 (half the bytes)
  but 32 at once slower (each step widens every weight, where float32 runs oneDNN's packed
  GEMMs; docs/benchmarks.md, "AVX2: ... bfloat16 without bfloat16 matmuls"), so such CPUs
  upcast, for the serving workload. A float32 checkpoint stays float32 everywhere on CPU: that
  is the exact path, the one the equality tests against transformers use. float16 has no fast
  CPU path here and upcasts to float32.

The KV pages take the weights' dtype unless `--kv-cache-dtype bfloat16` narrows a float32 model's
on CPU: half the bytes a decode step's attention reads and twice the tokens in the same memory,
each K/V value rounded once as it is written (llama.cpp's server keeps an f16 cache by default).
The exact path, the one the equality tests use, stays float32 pages.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from kvserve.model_service.kernels.onednn import native_bfloat16


def checkpoint_dtype(path: Path) -> str | None:
    """The dtype config.json names ("torch_dtype", or "dtype" as newer transformers write it)."""
    try:
        config = json.loads((Path(path) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    name = config.get("torch_dtype") or config.get("dtype")
    return name if isinstance(name, str) else None


def pick_dtype(name: str, device: torch.device, checkpoint: str | None = None) -> torch.dtype:
    """--dtype NAME -> the dtype; `checkpoint`: what checkpoint_dtype() read, for auto on CPU."""
    if name != "auto":
        return getattr(torch, name)
    if device.type == "cuda":
        return torch.bfloat16
    if checkpoint == "bfloat16" and native_bfloat16():
        return torch.bfloat16
    return torch.float32


def pick_kv_cache_dtype(name: str, model_dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """--kv-cache-dtype NAME -> the pages' dtype: auto (or the model's own) is the model's; bfloat16
    under a float32 model on CPU, where the kernels widen pages as they read them. Anything else is
    refused with the reason (ValueError)."""
    if name == "auto" or getattr(torch, name) == model_dtype:
        return model_dtype
    dtype = getattr(torch, name)
    model = str(model_dtype).removeprefix("torch.")
    if dtype.itemsize > model_dtype.itemsize:
        raise ValueError(f"--kv-cache-dtype {name}: wider than the model's {model} activations, it would "
                         f"hold nothing more than {model} pages; leave it auto")
    if device.type != "cpu":
        raise ValueError(f"--kv-cache-dtype {name} under a {model} model runs on CPU only: on {device.type} "
                         "the attention kernels read queries and pages of one dtype")
    if not (model_dtype == torch.float32 and dtype == torch.bfloat16):
        raise ValueError(f"--kv-cache-dtype {name} under a {model} model: the CPU kernels narrow only float32 "
                         "pages, to bfloat16")
    return dtype
