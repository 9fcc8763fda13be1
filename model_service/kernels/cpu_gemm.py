"""The native float32 GEMM (cpu_gemm.c): weights packed once into panels, called through ctypes.

Built when kvserve is installed and loaded by kernels/library.py. It needs AVX-512; elsewhere
load() says why and the linears run on oneDNN or F.linear (kernels/gemm.py chooses).
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from kvserve.model_service.kernels.library import KernelUnavailable, load_library, once_per_process

PANEL = 48   # output columns per panel (NR in the C file)
OPS = {"none": 0, "silu": 1, "mul": 2, "add": 3}

__all__ = ["CpuGemm", "KernelUnavailable", "PackedWeight", "load"]


@dataclass(frozen=True, slots=True)
class PackedWeight:
    """W (N, K), and its bias, checked once when packed: a call checks only its input."""
    panels: torch.Tensor             # (ceil(N / 48), K, 48) float32, the last panel zero-padded
    n: int
    k: int
    bias: torch.Tensor | None = None  # (N,) float32, contiguous


class CpuGemm:
    """pack(W, b) once; then y = op(x Wᵀ + b) for any number of rows."""

    def __init__(self, library: ctypes.CDLL, level: str) -> None:
        self.level = level   # the instruction-set level of the library loaded (kernels/levels.py)
        ptr, i64 = ctypes.c_void_p, ctypes.c_int64
        self._pack = library.kvserve_gemm_pack_f32
        self._pack.argtypes = [ptr, i64, i64, i64, i64, ptr, ctypes.c_int]
        self._pack.restype = None
        self._gemm = library.kvserve_gemm_f32
        self._gemm.argtypes = [ptr, i64, ptr, ptr, ptr, i64, i64, i64, i64, ctypes.c_int, ptr, i64, ctypes.c_int]
        self._gemm.restype = None

    def pack(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> PackedWeight:
        """W (N, K) float32, rows any distance apart; bias (N,) or None."""
        weight = _matrix(weight, "the weight")
        n, k = weight.shape
        if bias is not None:
            if not (_on_cpu_f32(bias) and bias.shape == (n,)):
                raise ValueError(f"cpu gemm: the bias must be ({n},) float32 on the CPU")
            bias = bias.detach().contiguous()
        return PackedWeight(self._panels(weight.data_ptr(), n, k, weight.stride(0), 1), n, k, bias)

    def pack_transposed(self, v: torch.Tensor) -> PackedWeight:
        """W = Vᵀ, from V (K, N) float32 (rows any distance apart): attention's P V."""
        v = _matrix(v, "V")
        k, n = v.shape
        return PackedWeight(self._panels(v.data_ptr(), n, k, 1, v.stride(0)), n, k)

    def _panels(self, data: int, n: int, k: int, col_stride: int, k_stride: int) -> torch.Tensor:
        panels = torch.empty(-(-n // PANEL), k, PANEL, dtype=torch.float32, device="cpu")
        self._pack(data, n, k, col_stride, k_stride, panels.data_ptr(), torch.get_num_threads())
        return panels

    def __call__(self, x: torch.Tensor, w: PackedWeight, op: str = "none",
                 other: torch.Tensor | None = None) -> torch.Tensor:
        """op(x Wᵀ + b) for x (..., K): silu, or `other` (..., N) multiplied or added."""
        # The C side trusts every pointer and size: check what the packing did not.
        if not (_on_cpu_f32(x) and x.dim() >= 1 and x.shape[-1] == w.k and op in OPS
                and (other is not None) == (op in ("mul", "add"))
                and (other is None or (_on_cpu_f32(other) and other.shape == (*x.shape[:-1], w.n)))):
            raise ValueError("cpu gemm: inconsistent shapes, dtypes, devices or op")
        # On every linear of every step: kept to plain tensor attributes.
        rows = _rows(x if x.dim() == 2 else x.reshape(-1, w.k))
        y = x.new_empty((*x.shape[:-1], w.n))   # float32 on the CPU, as x was checked to be
        if other is not None:
            other = _rows(other if other.dim() == 2 else other.reshape(-1, w.n))
        if rows.shape[0]:
            self._gemm(rows.data_ptr(), rows.stride(0), w.panels.data_ptr(),
                       None if w.bias is None else w.bias.data_ptr(), y.data_ptr(), w.n, rows.shape[0], w.n,
                       w.k, OPS[op], None if other is None else other.data_ptr(),
                       0 if other is None else other.stride(0), torch.get_num_threads())
        return y


def _on_cpu_f32(t: torch.Tensor) -> bool:
    return t.dtype == torch.float32 and t.is_cpu


def _rows(t: torch.Tensor) -> torch.Tensor:
    """A 2-D matrix whose rows are contiguous (a copy only if they are not); the rows themselves
    may be any distance apart: the C side only reads them."""
    return t if t.stride(1) == 1 or t.shape[1] == 1 else t.contiguous()


def _matrix(t: torch.Tensor, what: str) -> torch.Tensor:
    if t.dim() != 2 or not _on_cpu_f32(t):
        raise ValueError(f"cpu gemm: {what} must be a 2-D float32 CPU tensor")
    return _rows(t.detach())


def _load() -> CpuGemm:
    return CpuGemm(*load_library("cpu_gemm", "AVX-512 (its tiles are AVX-512 code)"))


load = once_per_process(_load)
