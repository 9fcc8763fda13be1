"""Rotary position embedding in place, one call per tensor (rope.c), through ctypes, float32 and
bfloat16.

Built when kvserve is installed and loaded by kernels/library.py; where it cannot be, load()
says why and RoPE runs as torch ops (model/rope.py).
"""

from __future__ import annotations

import ctypes

import torch

from kvserve.model_service.kernels.library import KernelUnavailable, load_library, once_per_process

__all__ = ["KernelUnavailable", "RopeKernel", "load"]


class RopeKernel:
    def __init__(self, library: ctypes.CDLL, level: str) -> None:
        self.level = level   # the instruction-set level of the library loaded (kernels/levels.py)
        ptr, i64 = ctypes.c_void_p, ctypes.c_int64
        self._fns = {}
        for dtype, name in ((torch.float32, "kvserve_rope_f32"), (torch.bfloat16, "kvserve_rope_bf16")):
            fn = getattr(library, name)
            fn.argtypes = [ptr, i64, i64, i64, i64, ptr, ptr, ctypes.c_int32]
            fn.restype = None
            self._fns[dtype] = fn

    def runs(self, x: torch.Tensor, cos: torch.Tensor) -> bool:
        """x (T, H, D) with its heads contiguous in each row (a view of a wider row is fine), cos
        (T, 1, D/2) contiguous, one dtype, on CPU."""
        return (x.dtype in self._fns and x.dtype == cos.dtype and x.device.type == "cpu" and x.dim() == 3
                and x.stride(2) == 1 and x.stride(1) == x.shape[2] and x.shape[2] % 2 == 0
                and cos.is_contiguous() and cos.shape == (x.shape[0], 1, x.shape[2] // 2))

    def __call__(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotates x in place (and returns it)."""
        if not (self.runs(x, cos) and sin.is_contiguous() and sin.shape == cos.shape and sin.dtype == cos.dtype):
            raise ValueError("rope: inconsistent shapes, strides, dtypes or device")
        return self._rotate(x, cos, sin)

    def rotate_pair(self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
                    sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """q and k rotated in place, or None (nothing touched) where runs() refuses either: the
        model's call, one check of each tensor."""
        if not (self.runs(q, cos) and self.runs(k, cos) and sin.is_contiguous() and sin.shape == cos.shape
                and sin.dtype == cos.dtype):
            return None
        return self._rotate(q, cos, sin), self._rotate(k, cos, sin)

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        t, h, d = x.shape
        self._fns[x.dtype](x.data_ptr(), t, h, d, x.stride(0), cos.data_ptr(), sin.data_ptr(),
                           torch.get_num_threads())
        return x


def _load() -> RopeKernel:
    return RopeKernel(*load_library("rope", "a CPU it was built for"))


load = once_per_process(_load)
