"""Each row's argmax of float32 logits (row_argmax.c), through ctypes, on torch's threads: each
scans the columns the step's LM head wrote on it, so no thread pulls another's logits through
the caches.

Built when kvserve is installed and loaded by kernels/library.py; where it cannot be, load()
says why and the sampler takes numpy's argmax (sampling/sampler.py).
"""

from __future__ import annotations

import ctypes

import torch

from kvserve.model_service.kernels.library import KernelUnavailable, load_library, once_per_process

__all__ = ["KernelUnavailable", "RowArgmaxKernel", "load"]


class RowArgmaxKernel:
    def __init__(self, library: ctypes.CDLL, level: str) -> None:
        self.level = level   # the instruction-set level of the library loaded (kernels/levels.py)
        self._fn = library.kvserve_row_argmax
        self._fn.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int32, ctypes.c_void_p]
        self._fn.restype = None

    @staticmethod
    def runs(x: torch.Tensor) -> bool:
        """Whether it takes x: (rows, n >= 1) float32, contiguous, on CPU."""
        return (x.dtype == torch.float32 and x.device.type == "cpu" and x.dim() == 2 and x.shape[1] > 0
                and x.is_contiguous())

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x as runs() takes it -> (rows,) int64: torch.argmax(x, dim=-1), ties and NaN included."""
        if not self.runs(x):
            raise ValueError("row argmax: a contiguous (rows, n >= 1) float32 CPU tensor")
        out = torch.empty(x.shape[0], dtype=torch.int64)
        # ctypes drops the GIL for the call, as a torch op does.
        self._fn(x.data_ptr(), x.shape[0], x.shape[1], torch.get_num_threads(), out.data_ptr())
        return out


def _load() -> RowArgmaxKernel:
    return RowArgmaxKernel(*load_library("row_argmax", "a CPU it was built for"))


load = once_per_process(_load)
