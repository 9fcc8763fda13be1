"""Pick an attention backend by name: "auto", "torch", "cpu" or "flash_attn"."""

from __future__ import annotations

import logging

import torch

from kvserve.model_service.attention import cpu_decode_kernel
from kvserve.model_service.attention.base import AttentionBackend
from kvserve.model_service.attention.cpu_backend import CpuAttentionBackend
from kvserve.model_service.attention.flash_attn_backend import FlashAttnBackend, load_flash_api
from kvserve.model_service.attention.torch_backend import TorchAttentionBackend
from kvserve.model_service.model import cpu_gemm

BACKEND_NAMES = ("auto", "torch", "cpu", "flash_attn")
log = logging.getLogger(__name__)


def select_backend(name: str = "auto", device: torch.device | str = "cpu", page_size: int | None = None,
                   dtype: torch.dtype | None = None, head_floats: int | None = None,
                   gemm: str = "native") -> AttentionBackend:
    """auto: flash_attn on CUDA when flash-attn imports (and, if page_size is given,
    accepts it); cpu on CPU in float32 when its kernel builds; else torch. An explicit
    name is honoured or fails, saying why. head_floats: num_heads x head_dim, if known.
    gemm: the model's GEMM (linear.choose_gemm); the cpu backend's chunk products use the
    native one only when the model does, where it builds."""
    device = torch.device(device)
    if name == "torch":
        return TorchAttentionBackend()
    if name == "flash_attn":
        if device.type != "cuda":
            raise RuntimeError(f"the flash_attn backend runs on CUDA only, not on {device}")
        return FlashAttnBackend()
    if name == "cpu":
        return _cpu_backend(device, page_size, dtype, head_floats, gemm)
    if name != "auto":
        raise ValueError(f"unknown attention backend {name!r}; choose from {', '.join(BACKEND_NAMES)}")
    if device.type == "cuda" and load_flash_api() is not None:
        backend = FlashAttnBackend()
        if page_size is None or page_size % backend.page_size_multiple() == 0:
            return backend
        log.info("attention: flash_attn wants page_size %% %d == 0, got %d; using torch",
                 backend.page_size_multiple(), page_size)
    if device.type == "cpu":   # _cpu_backend says why not (bfloat16, no compiler, ...)
        try:
            return _cpu_backend(device, page_size, dtype, head_floats, gemm)
        except RuntimeError as exc:   # a kernel that should build and does not is worth a warning
            unbuilt = isinstance(exc.__cause__, cpu_decode_kernel.KernelUnavailable)
            log.log(logging.WARNING if unbuilt else logging.INFO, "attention: %s; using torch", exc)
    return TorchAttentionBackend()


def _cpu_backend(device: torch.device, page_size: int | None, dtype: torch.dtype | None,
                 head_floats: int | None, gemm: str) -> CpuAttentionBackend:
    if device.type != "cpu":
        raise RuntimeError(f"the cpu attention backend runs on CPU only, not on {device}")
    if dtype not in (None, torch.float32):
        raise RuntimeError(f"the cpu attention backend's kernel is float32 only, not {dtype}")
    if page_size is not None and page_size > cpu_decode_kernel.MAX_PAGE_SIZE:
        raise RuntimeError(f"the cpu attention backend takes pages of at most "
                           f"{cpu_decode_kernel.MAX_PAGE_SIZE} tokens, not {page_size}")
    if head_floats is not None and head_floats > cpu_decode_kernel.MAX_HEAD_FLOATS:
        raise RuntimeError(f"the cpu attention backend takes num_heads x head_dim up to "
                           f"{cpu_decode_kernel.MAX_HEAD_FLOATS}, not {head_floats}")
    try:
        kernel = cpu_decode_kernel.load()
    except cpu_decode_kernel.KernelUnavailable as exc:
        raise RuntimeError(f"the cpu attention backend's kernel is unavailable: {exc}") from exc
    native = None
    if gemm == "native":
        try:
            native = cpu_gemm.load()
        except cpu_gemm.KernelUnavailable:   # no AVX-512, say: chunk products stay on oneDNN
            pass
    return CpuAttentionBackend(kernel, native)
