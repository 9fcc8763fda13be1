"""Which GEMM runs the model's matmuls on CPU: `--cpu-gemm auto|native|onednn|torch`.

- onednn: oneDNN with packed weights (onednn.py); float32 and bfloat16; AVX2 or AVX-512.
- native: kvserve's float32 GEMM (cpu_gemm.c), weights packed in panels; AVX-512 only.
- torch:  F.linear (on x86, MKL).
`auto` takes the first that runs here, in AUTO_ORDER, a measured decision (docs/benchmarks.md,
"Which GEMM auto takes", has the runs and the machines): through `make bench-throughput`
oneDNN beat F.linear by far more than the run-to-run spread on an AVX2 machine, while the
native GEMM's lead over oneDNN on an AVX-512 one stayed inside it, so native is there to be
named (`--cpu-gemm native`), or taken where oneDNN does not run. A GEMM asked for by name that
cannot run here is refused with the reason.
"""

from __future__ import annotations

import logging

import torch

from kvserve.model_service import choices
from kvserve.model_service.kernels import cpu_gemm
from kvserve.model_service.kernels.library import KernelUnavailable, NotForThisCpu
from kvserve.model_service.kernels.onednn import onednn_available

log = logging.getLogger(__name__)

GEMMS = ("auto", *choices.CPU_GEMMS)
AUTO_ORDER = choices.CPU_GEMMS   # the measured order (above)


def why_not(gemm: str, dtype: torch.dtype) -> str | None:
    """None where `gemm` runs here (CPU) in `dtype`, else why it cannot."""
    if gemm == "native":
        if dtype != torch.float32:
            return f"it runs float32, not {dtype}"
        try:
            cpu_gemm.load()
        except KernelUnavailable as exc:
            return str(exc)
        return None
    if gemm == "onednn":
        return None if onednn_available(dtype) else f"oneDNN linears do not run here in {dtype}"
    return None


def choose_gemm(name: str, dtype: torch.dtype, device: torch.device) -> str:
    """--cpu-gemm NAME -> the GEMM the linears run. Off CPU: torch."""
    if name not in GEMMS:
        raise ValueError(f"unknown GEMM {name!r}: one of {', '.join(GEMMS)}")
    if device.type != "cpu" or name == "torch":
        if name not in ("auto", "torch"):
            raise ValueError(f"the {name} GEMM runs on CPU, not {device}")
        return "torch"
    if name != "auto":
        reason = why_not(name, dtype)
        if reason is not None:
            raise ValueError(f"the {name} CPU GEMM cannot run here: {reason}")
        return name
    for gemm in AUTO_ORDER:
        if why_not(gemm, dtype) is None:
            return gemm
        if gemm == "native" and dtype == torch.float32:
            _warn_if_missing()
    return "torch"


def _warn_if_missing() -> None:
    """A warning where the native GEMM should load (the CPU has what it needs) and does not."""
    try:
        cpu_gemm.load()
    except NotForThisCpu:
        pass
    except KernelUnavailable as exc:
        log.warning("the native CPU GEMM is unavailable (%s)", exc)
