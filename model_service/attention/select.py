"""Pick an attention backend by name: "auto", "torch" or "flash_attn"."""

from __future__ import annotations

import logging

import torch

from model_service.attention.base import AttentionBackend
from model_service.attention.flash_attn_backend import FlashAttnBackend, load_flash_api
from model_service.attention.torch_backend import TorchAttentionBackend

BACKEND_NAMES = ("auto", "torch", "flash_attn")
log = logging.getLogger(__name__)


def select_backend(name: str = "auto", device: torch.device | str = "cpu",
                   page_size: int | None = None) -> AttentionBackend:
    """auto: flash_attn on CUDA when flash-attn imports (and, if page_size is
    given, accepts it), else torch. An explicit name is honoured or fails."""
    device = torch.device(device)
    if name == "torch":
        return TorchAttentionBackend()
    if name == "flash_attn":
        if device.type != "cuda":
            raise RuntimeError(f"the flash_attn backend runs on CUDA only, not on {device}")
        return FlashAttnBackend()
    if name != "auto":
        raise ValueError(f"unknown attention backend {name!r}; choose from {', '.join(BACKEND_NAMES)}")
    if device.type == "cuda" and load_flash_api() is not None:
        backend = FlashAttnBackend()
        if page_size is None or page_size % backend.page_size_multiple() == 0:
            return backend
        log.info("attention: flash_attn wants page_size %% %d == 0, got %d; using torch",
                 backend.page_size_multiple(), page_size)
    return TorchAttentionBackend()
