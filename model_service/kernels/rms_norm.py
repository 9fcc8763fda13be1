"""RMSNorm in one call per tensor (rms_norm.c), through ctypes, float32 and bfloat16.

Built when kvserve is installed and loaded by kernels/library.py; where it cannot be, load()
says why and RMSNorm runs as torch ops (model/layers.py).
"""

from __future__ import annotations

import ctypes

import torch

from kvserve.model_service.kernels.library import KernelUnavailable, load_library, once_per_process

__all__ = ["KernelUnavailable", "RmsNormKernel", "load"]


class RmsNormKernel:
    def __init__(self, library: ctypes.CDLL, level: str) -> None:
        self.level = level   # the instruction-set level of the library loaded (kernels/levels.py)
        ptr, i64 = ctypes.c_void_p, ctypes.c_int64
        self._fns = {}
        for dtype, name in ((torch.float32, "kvserve_rms_norm_f32"), (torch.bfloat16, "kvserve_rms_norm_bf16")):
            fn = getattr(library, name)
            fn.argtypes = [ptr, ptr, ptr, i64, i64, ctypes.c_float, ctypes.c_int32]
            fn.restype = None
            self._fns[dtype] = fn

    def runs(self, x: torch.Tensor, weight: torch.Tensor) -> bool:
        """Whether this call can take x: contiguous on CPU, its last dim the weight's, one dtype."""
        return (x.dtype in self._fns and x.dtype == weight.dtype and x.device.type == "cpu"
                and x.is_contiguous() and x.dim() >= 1 and weight.dim() == 1 and x.shape[-1] == weight.shape[0] >= 1
                and weight.is_contiguous())

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """weight * normalised x over the last dim; x (..., n) as runs() accepts."""
        y = self.maybe(x, weight, eps)
        if y is None:
            raise ValueError("rms norm: inconsistent shapes, strides, dtypes or device")
        return y

    def maybe(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor | None:
        """The same, or None where runs() refuses x (the caller then runs the torch ops): one
        check a call on the hot path."""
        if not self.runs(x, weight):
            return None
        n = x.shape[-1]
        y = torch.empty_like(x)
        # ctypes drops the GIL for the call, as a torch op does.
        self._fns[x.dtype](x.data_ptr(), weight.data_ptr(), y.data_ptr(), x.numel() // n, n, eps,
                           torch.get_num_threads())
        return y


def _load() -> RmsNormKernel:
    return RmsNormKernel(*load_library("rms_norm", "a CPU it was built for"))


load = once_per_process(_load)
