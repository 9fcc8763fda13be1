"""The native float32 GEMM (cpu_gemm.c): weights packed once into panels, called through ctypes.

Built on first use like every native kernel (model_service/native_build.py). It needs
AVX-512; elsewhere load() says why and linears run on oneDNN or F.linear (linear.choose_gemm).
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from model_service.native_build import KernelUnavailable, build_and_load, cpu_flags, once_per_process

SOURCE = Path(__file__).with_name("cpu_gemm.c")
PANEL = 32   # output columns per panel (NR in the C file)
OPS = {"none": 0, "silu": 1, "mul": 2, "add": 3}

__all__ = ["CpuGemm", "KernelUnavailable", "load"]


class CpuGemm:
    """pack(W) once; then y = op(x Wᵀ + b) for any number of rows."""

    def __init__(self, library: ctypes.CDLL, path: Path) -> None:
        self.path = path
        ptr, i64 = ctypes.c_void_p, ctypes.c_int64
        self._pack = library.kvserve_gemm_pack_f32
        self._pack.argtypes = [ptr, i64, i64, i64, i64, ptr, ctypes.c_int]
        self._pack.restype = None
        self._gemm = library.kvserve_gemm_f32
        self._gemm.argtypes = [ptr, i64, ptr, ptr, ptr, i64, i64, i64, i64, ctypes.c_int, ptr, i64, ctypes.c_int]
        self._gemm.restype = None

    def pack(self, weight: torch.Tensor) -> torch.Tensor:
        """W (N, K) float32 (rows any distance apart) -> panels (ceil(N / 32), K, 32), the last
        zero-padded."""
        weight = _rows(weight, "the weight")
        n, k = weight.shape
        panels = torch.empty(-(-n // PANEL), k, PANEL, dtype=torch.float32, device="cpu")
        self._pack(weight.data_ptr(), n, k, weight.stride(0), 1, panels.data_ptr(), torch.get_num_threads())
        return panels

    def pack_transposed(self, v: torch.Tensor) -> torch.Tensor:
        """The panels of W = Vᵀ, from V (K, N) float32 (rows any distance apart)."""
        v = _rows(v, "V")
        k, n = v.shape
        panels = torch.empty(-(-n // PANEL), k, PANEL, dtype=torch.float32, device="cpu")
        self._pack(v.data_ptr(), n, k, 1, v.stride(0), panels.data_ptr(), torch.get_num_threads())
        return panels

    def __call__(self, x: torch.Tensor, panels: torch.Tensor, n: int, bias: torch.Tensor | None = None,
                 op: str = "none", other: torch.Tensor | None = None) -> torch.Tensor:
        """op(x Wᵀ + bias) for x (..., K): silu, or `other` (..., N) multiplied or added."""
        # The C side trusts every pointer and size: check what it cannot.
        if not (_on_cpu_f32(panels) and panels.dim() == 3 and panels.shape[2] == PANEL and panels.is_contiguous()
                and panels.shape[0] * PANEL >= n > panels.shape[0] * PANEL - PANEL
                and _on_cpu_f32(x) and x.dim() >= 1 and x.shape[-1] == panels.shape[1] and op in OPS
                and (bias is None or (_on_cpu_f32(bias) and bias.shape == (n,) and bias.is_contiguous()))
                and (other is not None) == (op in ("mul", "add"))
                and (other is None or (_on_cpu_f32(other) and other.shape == (*x.shape[:-1], n)))):
            raise ValueError("cpu gemm: inconsistent shapes, dtypes, devices or op")
        k = panels.shape[1]
        rows = _rows(x.reshape(-1, k), "x")
        y = torch.empty(*x.shape[:-1], n, dtype=torch.float32, device="cpu")
        if other is not None:
            other = _rows(other.reshape(-1, n), "other")
        if rows.shape[0]:
            self._gemm(rows.data_ptr(), rows.stride(0), panels.data_ptr(),
                       None if bias is None else bias.data_ptr(), y.data_ptr(), n, rows.shape[0], n, k, OPS[op],
                       None if other is None else other.data_ptr(), 0 if other is None else other.stride(0),
                       torch.get_num_threads())
        return y


def _on_cpu_f32(t: torch.Tensor) -> bool:
    return t.dtype == torch.float32 and t.device.type == "cpu"


def _rows(t: torch.Tensor, what: str) -> torch.Tensor:
    """t as a 2-D float32 CPU matrix whose rows are contiguous (a copy only if they are not);
    the rows themselves may be any distance apart: the C side only reads them."""
    if t.dim() != 2 or not _on_cpu_f32(t):
        raise ValueError(f"cpu gemm: {what} must be a 2-D float32 CPU tensor")
    t = t.detach()
    return t if t.stride(1) == 1 or t.shape[1] == 1 else t.contiguous()


def _build_and_load() -> CpuGemm:
    if "avx512f" not in cpu_flags().split():
        raise KernelUnavailable("this CPU has no AVX-512 (the cpu gemm's tiles are AVX-512 code)")
    library, path = build_and_load(SOURCE)
    return CpuGemm(library, path)


load = once_per_process(_build_and_load)
