"""The native paged decode kernel (paged_decode.c), called through ctypes.

Built when kvserve is installed and loaded by kernels/library.py; where it cannot be,
load() says why and the attention backends serve with torch's own ops.
"""

from __future__ import annotations

import ctypes

import torch

from kvserve.model_service.kernels.library import KernelUnavailable, load_library, once_per_process

MAX_HEAD_FLOATS = 16384   # num_heads * head_dim: three such arrays live on a thread's stack
MAX_PAGE_SIZE = 256       # the page's scores live on the stack too
CAUSAL_MAX_HEAD_DIM = 512  # the causal kernel's blocks of 16 queries live on the stack (paged_decode.c)
DTYPES = (torch.float32, torch.bfloat16)   # the decode's; the chunk softmax is float32


def cache_dtypes_for(dtype: torch.dtype) -> tuple[torch.dtype, ...]:
    """The cache dtypes the kernels read beside queries of `dtype`: their own, and bfloat16 pages
    under float32 queries (a float32 model with --kv-cache-dtype bfloat16); none for another dtype."""
    return {torch.float32: DTYPES, torch.bfloat16: (torch.bfloat16,)}.get(dtype, ())

__all__ = ["KernelUnavailable", "PagedDecodeKernel", "cache_dtypes_for", "load"]


class PagedDecodeKernel:
    """out (n, H, D) = attention of q (n, H, D), one query per sequence, over its pages
    (float32 or bfloat16); causal_attention, a prefill chunk's (float32); and chunk_softmax, for
    the matmul path of a chunk behind a cached prefix (float32)."""

    def __init__(self, library: ctypes.CDLL, level: str) -> None:
        self.level = level   # the instruction-set level of the library loaded (kernels/levels.py)
        fn = library.kvserve_paged_decode
        ptr, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32
        fn.argtypes = [ptr, ptr, ptr, ptr, i64, ptr, ptr, i64, i64, i64, i64, i64, ctypes.c_float, i32, i32, i32]
        fn.restype = None
        self._fn = fn
        causal = library.kvserve_causal_attention_f32
        causal.argtypes = [ptr, i64, ptr, ptr, i64, ptr, i64, i64, i64, i64, i64, i64, ctypes.c_float, ptr, i32]
        causal.restype = i32
        self._causal = causal
        self._kt = torch.empty(0)   # the causal kernel's transposed keys, grown to the largest chunk seen
        softmax = library.kvserve_chunk_softmax_f32
        softmax.argtypes = [ptr, i64, i64, i64, i64, ctypes.c_float, ctypes.c_int32]
        softmax.restype = None
        self._softmax = softmax

    @staticmethod
    def _check_values(tables: torch.Tensor, seq_lens: torch.Tensor, num_pages: int, page_size: int) -> None:
        """Every length >= 1 and within its table's width, every page id within the cache: the C
        side reads where they say (a page id past the pool was a segfault). One pass over each,
        at every call: inference tensors keep no version to tell a change by."""
        (shortest, longest), (lowest, highest) = (map(int, t.aminmax()) for t in (seq_lens, tables))
        if not (shortest >= 1 and longest <= tables.shape[1] * page_size and 0 <= lowest and highest < num_pages):
            raise ValueError("paged decode kernel: a length or a page id outside the tables or the KV cache")

    def __call__(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 tables: torch.Tensor, seq_lens: torch.Tensor, scale: float, max_len: int) -> torch.Tensor:
        """q and the caches float32, or all bfloat16, or q float32 over bfloat16 caches
        (cache_dtypes_for; out is q's dtype); tables (n, >= pages)
        int32 with rows contiguous, seq_lens (n,) int32, each >= 1; max_len: the longest of
        seq_lens (the caller has it as a Python int)."""
        n, h, d = q.shape
        q = q.contiguous()
        out = torch.empty_like(q)
        if not n:   # (the C side divides the work by the sequences)
            return out
        # The C side trusts every pointer and stride: check what it cannot.
        if not (tables.shape[0] == seq_lens.shape[0] == n and k_cache.shape == v_cache.shape
                and k_cache.is_contiguous() and v_cache.is_contiguous() and tables.stride(1) == 1
                and seq_lens.is_contiguous() and tables.dtype == seq_lens.dtype == torch.int32
                and h % k_cache.shape[2] == 0 and k_cache.shape[3] == d
                and k_cache.dtype == v_cache.dtype and k_cache.dtype in cache_dtypes_for(q.dtype)
                and q.device.type == "cpu"
                and h * d <= MAX_HEAD_FLOATS and k_cache.shape[1] <= MAX_PAGE_SIZE
                and max_len <= tables.shape[1] * k_cache.shape[1]):
            raise ValueError("paged decode kernel: inconsistent shapes, strides or dtypes")
        self._check_values(tables, seq_lens, k_cache.shape[0], k_cache.shape[1])
        # ctypes drops the GIL for the call, as a torch op does.
        self._fn(q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), tables.data_ptr(), tables.stride(0),
                 seq_lens.data_ptr(), out.data_ptr(), n, h, k_cache.shape[2], d, k_cache.shape[1],
                 scale, int(q.dtype == torch.bfloat16), int(k_cache.dtype == torch.bfloat16), torch.get_num_threads())
        return out


    def takes_causal(self, head_dim: int) -> bool:
        """Whether causal_attention runs here: the AVX-512 build (its only one), head_dim a multiple
        of 16 up to CAUSAL_MAX_HEAD_DIM. The C side checks the same and declines otherwise."""
        return self.level == "avx512" and head_dim % 16 == 0 and head_dim <= CAUSAL_MAX_HEAD_DIM

    def causal_attention(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, cached: int,
                         scale: float) -> torch.Tensor | None:
        """A prefill chunk's causal attention, float32: q (L, H, D), rows of any stride, query i at
        position cached + i; keys and values (cached + L, Hk, D) contiguous. -> (L, H, D), query i
        over keys 0 .. cached + i; None where this build has no such kernel (not AVX-512, or D not a
        multiple of 16): the caller attends another way."""
        length, h, d = q.shape
        s, hk = keys.shape[0], keys.shape[1]
        if q.stride(2) != 1 or q.stride(1) != d:   # rows may be apart (a view of the fused qkv), heads not
            q = q.contiguous()
        if not (q.dtype == keys.dtype == values.dtype == torch.float32 and q.device.type == "cpu"
                and keys.is_contiguous() and values.is_contiguous()
                and keys.shape == values.shape == (s, hk, d) and h % hk == 0 and cached >= 0
                and s == cached + length >= 1):
            raise ValueError("causal attention: inconsistent shapes, strides or dtypes")
        need = hk * d * -(-s // 16) * 16
        if self._kt.numel() < need:
            self._kt = torch.empty(need)
        out = torch.empty(length, h, d)
        done = self._causal(q.data_ptr(), q.stride(0), keys.data_ptr(), values.data_ptr(), hk * d, out.data_ptr(),
                            h * d, length, cached, h, hk, d, scale, self._kt.data_ptr(), torch.get_num_threads())
        return out if done else None

    def chunk_softmax(self, scores: torch.Tensor, chunk: int, cached: int, scale: float) -> torch.Tensor:
        """scores (rows, cached + chunk) float32, row r for query r % chunk, in place: the softmax
        of scale * scores over the keys query r % chunk sees (cached + r % chunk + 1), 0 beyond."""
        rows, cols = scores.shape
        if not (scores.dtype == torch.float32 and scores.device.type == "cpu" and scores.is_contiguous()
                and chunk >= 1 and cached >= 0 and cols == cached + chunk and rows % chunk == 0 and scale > 0):
            raise ValueError("chunk softmax: inconsistent shapes, dtype or scale")
        self._softmax(scores.data_ptr(), rows, cols, chunk, cached, scale, torch.get_num_threads())
        return scores


def _load() -> PagedDecodeKernel:
    return PagedDecodeKernel(*load_library("paged_decode", "a CPU it was built for"))


load = once_per_process(_load)
