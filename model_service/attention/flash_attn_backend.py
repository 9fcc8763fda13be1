"""Attention through flash-attn's paged kernels (CUDA, float16/bfloat16).

Whichever flash-attn API imports is used, behind the one backend interface:

- flash-attn 2 (`flash_attn`): `flash_attn_with_kvcache` for decode-only steps
  (one query per sequence, cache_seqlens + block_table), `flash_attn_varlen_func`
  with block_table for every other step. Its paged kernels need
  page_size % 256 == 0.
- flash-attn 4 (`flash_attn.cute`, Hopper/Blackwell): `flash_attn_varlen_func`
  with page_table and seqused_k for every step. Any page size; 128 takes the
  TMA path. (Early flash-attn 4 releases support paged KV on Blackwell only.)

Both take causal masks aligned to the bottom right when a chunk's query
length is shorter than its key length, which is chunked prefill's rule: query
i of a chunk at position cached + i sees keys 0 .. cached + i.

Nothing here imports flash-attn at module import, so this module loads on a
CPU-only machine; constructing the backend there raises RuntimeError.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from kvserve.model_service.batch import ForwardBatch


@dataclass(frozen=True, slots=True)
class FlashApi:
    version: int                         # 2 or 4
    varlen: Callable[..., Any]
    with_kvcache: Callable[..., Any] | None   # flash-attn 2 only


def load_flash_api() -> FlashApi | None:
    """The flash-attn API that imports here, or None."""
    try:
        from flash_attn import flash_attn_varlen_func, flash_attn_with_kvcache
        return FlashApi(2, flash_attn_varlen_func, flash_attn_with_kvcache)
    except Exception:   # ImportError, or a CUDA/ABI mismatch raised while loading the extension
        pass
    try:
        from flash_attn.cute import flash_attn_varlen_func
        return FlashApi(4, flash_attn_varlen_func, None)
    except Exception:
        return None


FA4_VERIFIED = "4.0.0b36"   # the release verified on Hopper (docs/benchmarks.md); earlier ones refused paged KV there


def fa4_unfit(device: torch.device | str | None = None) -> str | None:
    """Why flash-attn 4 cannot run paged attention on `device`, or None: its interface refuses
    page tables on compute capability 8.x and 12.x, and releases before FA4_VERIFIED on Hopper."""
    if not torch.cuda.is_available():
        return "flash-attn 4 needs a CUDA GPU"
    major = torch.cuda.get_device_capability(device)[0]
    if major not in (9, 10, 11):
        return (f"flash-attn 4 reads paged KV on Hopper and Blackwell data-center GPUs (compute capability "
                f"9.x to 11.x), not on this one ({major}.x)")
    try:
        from importlib.metadata import PackageNotFoundError, version

        from packaging.version import Version
        installed = version("flash-attn-4")
    except (ImportError, PackageNotFoundError):   # a build from source: nothing to compare
        return None
    if Version(installed) < Version(FA4_VERIFIED):
        return f"flash-attn-4 {installed} predates {FA4_VERIFIED}, the release verified with paged KV here"
    return None


def why_not_flash(device: torch.device | str | None = None) -> str | None:
    """Why the flash_attn backend cannot run here (on `device`), or None when it can."""
    if not torch.cuda.is_available():
        return "the flash_attn backend needs CUDA"
    try:
        FlashAttnBackend(device)
    except RuntimeError as exc:
        return str(exc)
    return None


@dataclass(slots=True)
class FlashAttnMeta:
    slot_mapping: torch.Tensor     # (T,) int64
    cu_seqlens_q: torch.Tensor     # (B+1,) int32
    cu_seqlens_k: torch.Tensor     # (B+1,) int32, running sum of seq_lens
    seq_lens: torch.Tensor         # (B,) int32
    block_tables: torch.Tensor     # (B, max_pages) int32
    max_seqlen_q: int
    max_seqlen_k: int
    decode_only: bool


class FlashAttnBackend:
    name = "flash_attn"
    graph_safe = True   # every per-step value is read from tensors: a step may be a CUDA graph (engine/decode_graphs.py)

    window: int | None = None   # sliding window (every layer), set by the model service's assembly

    def native_decode(self, meta) -> None:
        return None   # flash-attn attends on the GPU: no fused CPU layer

    def decodes_natively(self) -> bool:
        return False

    def set_window(self, window: int | None, sinks: int = 0, page_size: int = 0,
                   layer_windows: tuple = ()) -> None:
        if window is None and any(layer_windows):
            raise RuntimeError("the flash_attn backend takes one window for every layer; a model mixing "
                               "sliding and full layers runs on the torch backend")
        if sinks:
            raise RuntimeError("the flash_attn backend has no attention sinks; use the torch backend")
        self.window = window

    def _window(self) -> dict:
        return {"window_size": (self.window - 1, 0)} if self.window else {}

    def __init__(self, device: torch.device | str | None = None) -> None:
        """device: the GPU it will run on (default: the current one)."""
        api = load_flash_api()
        if api is None:
            raise RuntimeError("the flash_attn backend needs flash-attn 2 (`flash_attn`) or "
                               "flash-attn 4 (`flash_attn.cute`) and a CUDA GPU; neither imports "
                               "here. Use the torch backend.")
        if api.version == 4:
            why = fa4_unfit(device)
            if why is not None:
                raise RuntimeError(f"{why}; install flash-attn 2 or use the torch backend")
        self.api = api

    def page_size_multiple(self) -> int:
        return 256 if self.api.version == 2 else 1

    def default_page_size(self) -> int:
        # flash-attn 4 loads a page by TMA when it holds exactly one key tile (128 rows for head
        # dims up to 128 on Hopper); other sizes take its slower cp.async path.
        return 256 if self.api.version == 2 else 128

    def prepare(self, batch: ForwardBatch) -> FlashAttnMeta:
        seq_lens = batch.seq_lens.to(torch.int32)
        cu_k = torch.zeros(seq_lens.shape[0] + 1, dtype=torch.int32, device=seq_lens.device)
        torch.cumsum(seq_lens, 0, out=cu_k[1:])
        return FlashAttnMeta(
            slot_mapping=batch.slot_mapping, cu_seqlens_q=batch.cu_seqlens_q.to(torch.int32),
            cu_seqlens_k=cu_k, seq_lens=seq_lens, block_tables=batch.block_tables.to(torch.int32),
            max_seqlen_q=batch.max_seqlen_q, max_seqlen_k=batch.max_seqlen_k,
            decode_only=batch.num_decodes == batch.num_seqs)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                k_cache: torch.Tensor, v_cache: torch.Tensor,
                meta: FlashAttnMeta, scale: float) -> torch.Tensor:
        if q.dtype not in (torch.float16, torch.bfloat16):
            raise RuntimeError(f"flash-attn needs float16 or bfloat16, got {q.dtype}")
        hk, d = k_cache.shape[2], k_cache.shape[3]
        k_cache.view(-1, hk, d).index_copy_(0, meta.slot_mapping, k)   # (pages*page, Hk, D)
        v_cache.view(-1, hk, d).index_copy_(0, meta.slot_mapping, v)
        if self.api.version == 4:
            out = self.api.varlen(
                q, k_cache, v_cache, cu_seqlens_q=meta.cu_seqlens_q, seqused_k=meta.seq_lens,
                max_seqlen_q=meta.max_seqlen_q, max_seqlen_k=meta.max_seqlen_k,
                page_table=meta.block_tables, softmax_scale=scale, causal=True, **self._window())
            return out[0] if isinstance(out, tuple) else out           # (out, lse) in some releases
        if meta.decode_only:
            out = self.api.with_kvcache(
                q.unsqueeze(1), k_cache, v_cache, cache_seqlens=meta.seq_lens,
                block_table=meta.block_tables, softmax_scale=scale, causal=True,
                **self._window())                                         # (B, 1, H, D)
            return out.squeeze(1)
        return self.api.varlen(
            q, k_cache, v_cache, meta.cu_seqlens_q, meta.cu_seqlens_k,
            meta.max_seqlen_q, meta.max_seqlen_k, softmax_scale=scale, causal=True,
            block_table=meta.block_tables, **self._window())                             # (T, H, D)
