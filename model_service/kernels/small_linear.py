"""The small-batch linear (small_linear.c), called through ctypes: x Wᵀ + b for a few rows of
x, with W in its plain layout (float32 or bfloat16) and an optional op in the epilogue.

Built when kvserve is installed and loaded by kernels/library.py; where it cannot be, load()
says why and every linear runs on the GEMM kernels/gemm.py chose.
"""

from __future__ import annotations

import ctypes

import torch

from kvserve.model_service.kernels.library import KernelUnavailable, load_library, once_per_process

__all__ = ["KernelUnavailable", "SmallLinear", "load"]

OPS = {"none": 0, "silu": 1, "mul": 2, "add": 3}
# Rows up to which the model sends a matmul here rather than to its packed GEMM (model/linear.py)
# and a decode step to the fused layer (decode_layer.py). Measured (docs/benchmarks.md, "Single
# stream"): on an AVX-512 Zen 4 the packed GEMMs win from about 4 rows on (at 8, 1.3x faster); on
# an AVX2 Zen 3 this kernel still led oneDNN a little at 8.
SMALL_ROWS = 4


class SmallLinear:
    def __init__(self, library: ctypes.CDLL, level: str) -> None:
        self.level = level   # the instruction-set level of the library loaded (kernels/levels.py)
        fn = library.kvserve_small_linear
        ptr, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32
        fn.argtypes = [ptr, i64, i64, ptr, i32, i64, ptr, i32, ptr, ptr, i32]
        fn.restype = None
        self._fn = fn

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                 op: str = "none", other: torch.Tensor | None = None) -> torch.Tensor:
        """x (m, k) float32, weight (n, k) float32 or bfloat16, bias (n,) float32 -> (m, n) float32;
        other (m, n) float32 for op "mul" / "add"."""
        return self.bind(weight, bias)(x, op, other)

    def bind(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> BoundWeight:
        """The weight (and bias) checked once, for calls that then check only x (a Linear's)."""
        n = weight.shape[0]
        if not (weight.dim() == 2 and weight.is_contiguous() and weight.device.type == "cpu"
                and weight.dtype in (torch.float32, torch.bfloat16)
                and (bias is None or (bias.dtype == torch.float32 and bias.is_contiguous() and bias.shape == (n,)))):
            raise ValueError("small linear: the weight must be a contiguous (n, k) float32 or bfloat16 matrix "
                             "on CPU, the bias (n,) float32")
        return BoundWeight(self._fn, weight, bias)


class BoundWeight:
    """x Wᵀ + b with W and b fixed (checked by SmallLinear.bind)."""

    __slots__ = ("_fn", "weight", "bias", "_args")

    def __init__(self, fn, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        self._fn, self.weight, self.bias = fn, weight, bias
        n, k = weight.shape
        self._args = (k, weight.data_ptr(), int(weight.dtype == torch.bfloat16), n,
                      None if bias is None else bias.data_ptr())

    def __call__(self, x: torch.Tensor, op: str = "none", other: torch.Tensor | None = None) -> torch.Tensor:
        k, w, bf16, n, b = self._args
        # The C side trusts every pointer and size: check what it cannot.
        if not (x.dim() == 2 and x.shape[1] == k and x.dtype == torch.float32 and x.device.type == "cpu"
                and op in OPS and (other is None) == (op not in ("mul", "add"))):
            raise ValueError(f"small linear: x must be (m, {k}) float32 on CPU, op one of {', '.join(OPS)} "
                             "(mul and add with the other operand)")
        m = x.shape[0]
        x = x.contiguous()
        if other is not None:
            if not (other.dtype == torch.float32 and other.shape == (m, n)):
                raise ValueError(f"small linear: the other operand must be ({m}, {n}) float32")
            other = other.contiguous()
        y = torch.empty(m, n, dtype=torch.float32)
        # ctypes drops the GIL for the call, as a torch op does.
        self._fn(x.data_ptr(), m, k, w, bf16, n, b, OPS[op], None if other is None else other.data_ptr(),
                 y.data_ptr(), torch.get_num_threads())
        return y


def _load() -> SmallLinear:
    return SmallLinear(*load_library("small_linear", "a CPU it was built for"))


load = once_per_process(_load)
