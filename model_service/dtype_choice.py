"""`--dtype auto`: which dtype the weights and KV pages take.

- CUDA: bfloat16.
- CPU: the checkpoint's own dtype where the CPU computes it natively, else float32. A bfloat16
  checkpoint (most published Llama and Qwen weights) runs in bfloat16 on a CPU with AVX512-BF16
  or AMX, where oneDNN's bfloat16 GEMMs run on the CPU's own instructions; there it measured
  faster than float32 in both phases (half the bytes per decode step, and prefill on native
  bf16 dot products; docs/benchmarks.md, "Single stream"). Without them oneDNN refuses
  bfloat16 and torch converts on the fly, which measured 4-5x slower prefill than float32, so
  such CPUs upcast. A float32 checkpoint stays float32 everywhere on CPU: that is the exact
  path, the one the equality tests against transformers use. float16 has no fast CPU path here
  and upcasts to float32.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch


def checkpoint_dtype(path: Path) -> str | None:
    """The dtype config.json names ("torch_dtype", or "dtype" as newer transformers write it)."""
    try:
        config = json.loads((Path(path) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    name = config.get("torch_dtype") or config.get("dtype")
    return name if isinstance(name, str) else None


def native_bf16_cpu() -> bool:
    """Whether this CPU runs bfloat16 matmuls natively (oneDNN's own check: AVX512-BF16 or AMX)."""
    return torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()


def pick_dtype(name: str, device: torch.device, checkpoint: str | None = None) -> torch.dtype:
    """--dtype NAME -> the dtype; `checkpoint`: what checkpoint_dtype() read, for auto on CPU."""
    if name != "auto":
        return getattr(torch, name)
    if device.type == "cuda":
        return torch.bfloat16
    if checkpoint == "bfloat16" and native_bf16_cpu():
        return torch.bfloat16
    return torch.float32
