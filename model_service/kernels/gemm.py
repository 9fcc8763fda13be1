"""Which GEMM runs the model's matmuls on CPU: `--cpu-gemm auto|native|onednn|torch`.

- onednn: oneDNN with packed weights (onednn.py); float32 and bfloat16; AVX2 or AVX-512.
- native: kvserve's float32 GEMM (cpu_gemm.c), weights packed in panels; AVX-512 only. Calls of
  more than model/linear.py's NATIVE_MAX_ROWS rows run on the plain weight the small-batch
  linear keeps (through oneDNN where it runs), where the native GEMM falls behind.
- torch:  F.linear (on x86, MKL).
`auto` takes the first that runs here, in AUTO_ORDER, a measured decision (docs/benchmarks.md,
"Which GEMM auto takes" and "The native GEMM by rows, on Ice Lake", have the runs and the
machines): oneDNN beat F.linear by far more than the run-to-run spread on an AVX2 machine; on
an AVX-512 one the native GEMM, with prefill-sized calls on the plain weight, ran decode steps
of many sequences and the 32-request workload faster than oneDNN by more than the spread.
Without the plain weight (`--cpu-small-linear off`) every call would run native, prefill
included, so auto takes oneDNN first there. A GEMM asked for by name that cannot run here is
refused with the reason.
"""

from __future__ import annotations

import logging

import torch

from kvserve.model_service import choices
from kvserve.model_service.kernels import cpu_gemm
from kvserve.model_service.kernels.library import KernelUnavailable, NotForThisCpu
from kvserve.model_service.kernels.onednn import native_bfloat16, onednn_available

log = logging.getLogger(__name__)

GEMMS = ("auto", *choices.CPU_GEMMS)
AUTO_ORDER = ("native", "onednn", "torch")   # the measured order (above)
AUTO_ORDER_WITHOUT_PLAIN = ("onednn", "native", "torch")   # where nothing would run prefill beside native


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


def choose_gemm(name: str, dtype: torch.dtype, device: torch.device, plain_kept: bool = True) -> str:
    """--cpu-gemm NAME -> the GEMM the linears run. Off CPU: torch. plain_kept: whether the
    plain weights stay beside the packed ones (the small-batch linear's); auto takes the native
    GEMM first only then."""
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
    for gemm in AUTO_ORDER if plain_kept else AUTO_ORDER_WITHOUT_PLAIN:
        if why_not(gemm, dtype) is None:
            return gemm
        if gemm == "native" and dtype == torch.float32:
            _warn_if_missing()
    return "torch"


def widens_bfloat16(gemm: str, dtype: torch.dtype, device: torch.device) -> bool:
    """Whether the linears run their prefill-sized bfloat16 calls widened to float32
    (model/linear.py, Linear.widen_bfloat16): on F.linear, on a CPU without bfloat16 matmuls."""
    return gemm == "torch" and dtype == torch.bfloat16 and device.type == "cpu" and not native_bfloat16()


def _warn_if_missing() -> None:
    """A warning where the native GEMM should load (the CPU has what it needs) and does not."""
    try:
        cpu_gemm.load()
    except NotForThisCpu:
        pass
    except KernelUnavailable as exc:
        log.warning("the native CPU GEMM is unavailable (%s)", exc)
