"""Pick an attention backend by name: "auto", "torch", "cpu" or "flash_attn", and build it."""

from __future__ import annotations

import logging

import torch

from kvserve.model_service import choices
from kvserve.model_service.attention.base import AttentionBackend
from kvserve.model_service.attention.chunks import NativeChunks, OneDnnChunks
from kvserve.model_service.attention.decode import GatheredDecode, KernelDecode
from kvserve.model_service.attention.flash_attn_backend import FlashAttnBackend, load_flash_api
from kvserve.model_service.attention.page_gather import PageGather
from kvserve.model_service.attention.paged import PagedAttention
from kvserve.model_service.kernels import cpu_gemm, paged_decode
from kvserve.model_service.kernels.cpu_gemm import CpuGemm
from kvserve.model_service.kernels.library import KernelUnavailable, NotForThisCpu
from kvserve.model_service.kernels.paged_decode import PagedDecodeKernel

BACKEND_NAMES = ("auto", *choices.ATTENTION_BACKENDS)
log = logging.getLogger(__name__)


def select_backend(name: str = "auto", device: torch.device | str = "cpu", page_size: int | None = None,
                   dtype: torch.dtype | None = None, head_floats: int | None = None,
                   gemm: str = "native", windowed: bool = False) -> AttentionBackend:
    """auto: flash_attn on CUDA when flash-attn imports (and, if page_size is given,
    accepts it); cpu on CPU in float32 or bfloat16 when its kernel loads; else torch. An explicit
    name is honoured or fails, saying why. head_floats: num_heads x head_dim, if known.
    gemm: the model's GEMM (kernels/gemm.py); the cpu backend's chunk products use the
    native one only when the model does. windowed: the model has a sliding window, which the
    cpu backend's decode kernel does not take (auto picks torch on CPU then)."""
    device = torch.device(device)
    if name == "torch":
        return torch_attention()
    if name == "flash_attn":
        if device.type != "cuda":
            raise RuntimeError(f"the flash_attn backend runs on CUDA only, not on {device}")
        return FlashAttnBackend(device)
    if name == "cpu":
        return _cpu_backend(device, page_size, dtype, head_floats, gemm)
    if name != "auto":
        raise ValueError(f"unknown attention backend {name!r}; choose from {', '.join(BACKEND_NAMES)}")
    if device.type == "cuda" and load_flash_api() is not None:
        try:
            backend = FlashAttnBackend(device)
        except RuntimeError as exc:   # it imports, but not for this GPU
            log.info("attention: %s; using torch", exc)
        else:
            if page_size is None or page_size % backend.page_size_multiple() == 0:
                return backend
            log.info("attention: flash_attn wants page_size %% %d == 0, got %d; using torch",
                     backend.page_size_multiple(), page_size)
    if device.type == "cpu" and windowed:
        log.info("attention: a sliding-window model; using torch (the cpu kernel attends the whole context)")
    elif device.type == "cpu":   # _cpu_backend says why not (float16, no kernel built, ...)
        try:
            return _cpu_backend(device, page_size, dtype, head_floats, gemm)
        except RuntimeError as exc:   # a kernel that should load and does not is worth a warning
            cause = exc.__cause__
            missing = isinstance(cause, KernelUnavailable) and not isinstance(cause, NotForThisCpu)
            log.log(logging.WARNING if missing else logging.INFO, "attention: %s; using torch", exc)
    return torch_attention()


def torch_attention() -> PagedAttention:
    """The reference backend: SDPA over gathered pages; CPU and any GPU."""
    gather = PageGather()
    return PagedAttention("torch", GatheredDecode(gather), OneDnnChunks(), gather)


def cpu_attention(kernel: PagedDecodeKernel, gemm: CpuGemm | None = None) -> PagedAttention:
    """Decode rows through the native paged kernel, cached-prefix chunks through the native
    softmax and (where given) the native GEMM; the rest as the torch backend does it."""
    return PagedAttention("cpu", KernelDecode(kernel), NativeChunks(kernel, gemm), PageGather())


def _cpu_backend(device: torch.device, page_size: int | None, dtype: torch.dtype | None,
                 head_floats: int | None, gemm: str) -> PagedAttention:
    if device.type != "cpu":
        raise RuntimeError(f"the cpu attention backend runs on CPU only, not on {device}")
    if dtype not in (None, *paged_decode.DTYPES):
        raise RuntimeError(f"the cpu attention backend's kernel runs float32 and bfloat16, not {dtype}")
    if page_size is not None and page_size > paged_decode.MAX_PAGE_SIZE:
        raise RuntimeError(f"the cpu attention backend takes pages of at most "
                           f"{paged_decode.MAX_PAGE_SIZE} tokens, not {page_size}")
    if head_floats is not None and head_floats > paged_decode.MAX_HEAD_FLOATS:
        raise RuntimeError(f"the cpu attention backend takes num_heads x head_dim up to "
                           f"{paged_decode.MAX_HEAD_FLOATS}, not {head_floats}")
    try:
        kernel = paged_decode.load()
    except KernelUnavailable as exc:
        raise RuntimeError(f"the cpu attention backend's kernel is unavailable: {exc}") from exc
    native = None
    if gemm == "native":
        try:
            native = cpu_gemm.load()
        except KernelUnavailable:   # no AVX-512, say: the chunk products stay on oneDNN
            pass
    return cpu_attention(kernel, native)
