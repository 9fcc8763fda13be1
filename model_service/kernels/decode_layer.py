"""The fused decode layer (decode_layer.c), called through ctypes: one Llama-family decoder layer
of a decode step of at most MAX_ROWS sequences, float32 or bfloat16, every layer and then the
final norm and the LM head in one native call.

    kernel = load()
    layers = [kernel.bind(geometry, weights) ...]     once per layer, at load time
    whole = kernel.bind_step(layers, final_norm, head, eps)   once, at load time
    step = kernel.step(geometry, x, cos, sin, slots, tables, lens, k_cache)   once per step;
                                                      None: not for this step
    logits = whole(x, step, kv_caches)                every layer, the final norm and the LM head
                                                      in one call: (rows, vocab) float32
    direct = DirectStep(whole, embedding, rope_tables)   once, at load time
    logits = direct(ids, positions, slots, tables, lens, kv_caches)   the same step from plain ints:
                                                      the embedding rows and RoPE angles copied
                                                      here, no tensor built (None: not this step)

Built when kvserve is installed and loaded by kernels/library.py; where it cannot be, load()
says why and the layers run module by module.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from kvserve.model_service.kernels.library import KernelUnavailable, load_library, once_per_process
from kvserve.model_service.kernels.paged_decode import DTYPES, MAX_HEAD_FLOATS, MAX_PAGE_SIZE, cache_dtypes_for
from kvserve.model_service.kernels.small_linear import SMALL_ROWS

__all__ = ["KernelUnavailable", "DecodeLayerKernel", "DirectStep", "Geometry", "load"]

MAX_ROWS = SMALL_ROWS   # decode steps of up to this many sequences: beyond, the packed GEMMs win
WEIGHTS = ("input_norm", "qkv", "qkv_bias", "q_norm", "k_norm", "o", "o_bias",
           "post_norm", "gate", "gate_bias", "up", "up_bias", "down", "down_bias")
BIASES = frozenset(name for name in WEIGHTS if name.endswith("_bias"))   # float32 whatever the layer's dtype


class Unsupported(ValueError):
    """A model whose geometry this kernel does not take: its layers run module by module."""


class LayerStruct(ctypes.Structure):   # decode_layer.c's kvserve_layer
    _fields_ = ([(name, ctypes.c_int64) for name in ("hidden", "num_heads", "num_kv_heads", "head_dim",
                                                     "intermediate")]
                + [("eps", ctypes.c_float), ("scale", ctypes.c_float)]
                + [(name, ctypes.c_void_p) for name in WEIGHTS])


class ModelStruct(ctypes.Structure):   # decode_layer.c's kvserve_model
    _fields_ = [("num_layers", ctypes.c_int64), ("vocab", ctypes.c_int64), ("eps", ctypes.c_float),
                ("layers", ctypes.c_void_p), ("k_caches", ctypes.c_void_p), ("v_caches", ctypes.c_void_p),
                ("final_norm", ctypes.c_void_p), ("head", ctypes.c_void_p)]


@dataclass(frozen=True)
class Geometry:
    hidden: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate: int
    eps: float
    dtype: torch.dtype = torch.float32   # activations, norms and matrices (biases: float32); the caches
                                         # this dtype, or bfloat16 under float32 (cache_dtypes_for)

    def shapes(self) -> dict[str, tuple[int, ...]]:
        h, d, i = self.hidden, self.head_dim, self.intermediate
        q, kv = self.num_heads * d, self.num_kv_heads * d
        return {"input_norm": (h,), "qkv": (q + 2 * kv, h), "qkv_bias": (q + 2 * kv,), "q_norm": (d,),
                "k_norm": (d,), "o": (h, q), "o_bias": (h,), "post_norm": (h,), "gate": (i, h), "gate_bias": (i,),
                "up": (i, h), "up_bias": (i,), "down": (h, i), "down_bias": (h,)}

    def scratch_floats(self, rows: int) -> int:
        """Enough for either dtype's layout (decode_layer.c)."""
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        return rows * (2 * self.hidden + q + 2 * kv + q + self.intermediate)


@dataclass(slots=True)
class Step:
    """One step's per-row arguments, checked once for every layer (DecodeLayerKernel.step)."""
    rows: int
    cache_shape: tuple   # (num_pages, page_size, Hk, D): every layer's caches
    args: tuple   # cos, sin, slots, page size, tables, table stride, seq_lens: pointers and sizes
    keep: tuple   # the tensors behind the pointers


class DecodeLayerKernel:
    def __init__(self, library: ctypes.CDLL, level: str) -> None:
        self.level = level   # the instruction-set level of the library loaded (kernels/levels.py)
        ptr, i64 = ctypes.c_void_p, ctypes.c_int64
        self._step_fn = library.kvserve_decode_step
        self._step_fn.argtypes = [ptr, ptr, i64, ptr, ptr, ptr, i64, ptr, i64, ptr, ptr, ptr, ctypes.c_int32,
                                  ctypes.c_int32, ctypes.c_int32]
        self._step_fn.restype = None

    def bind(self, geometry: Geometry, weights: dict[str, torch.Tensor | None]) -> BoundLayer:
        """weights: WEIGHTS' names -> contiguous CPU tensors of geometry.shapes() in geometry.dtype
        (biases float32), or None for a bias or the q/k norms (both or neither) the model does not
        have."""
        g = geometry
        if g.num_heads % g.num_kv_heads or g.head_dim % 2 or g.num_heads * g.head_dim > MAX_HEAD_FLOATS:
            raise Unsupported("decode layer: heads or head_dim out of the kernel's range")
        if g.dtype not in DTYPES:
            raise Unsupported(f"decode layer: float32 or bfloat16, not {g.dtype}")
        shapes = g.shapes()
        required = {"input_norm", "qkv", "o", "post_norm", "gate", "up", "down"}
        if (weights.get("q_norm") is None) != (weights.get("k_norm") is None):
            raise ValueError("decode layer: q_norm and k_norm come together")
        pointers = {}
        for name in WEIGHTS:
            w = weights.get(name)
            if w is None:
                if name in required:
                    raise ValueError(f"decode layer: {name} is required")
                pointers[name] = None
                continue
            dtype = torch.float32 if name in BIASES else g.dtype
            if not (w.dtype == dtype and w.device.type == "cpu" and w.is_contiguous()
                    and tuple(w.shape) == shapes[name]):
                raise ValueError(f"decode layer: {name} must be a contiguous {dtype} CPU tensor of shape "
                                 f"{shapes[name]}, not {w.dtype} {tuple(w.shape)}")
            pointers[name] = w.data_ptr()
        struct = LayerStruct(g.hidden, g.num_heads, g.num_kv_heads, g.head_dim, g.intermediate, g.eps,
                             g.head_dim ** -0.5, *(pointers[name] for name in WEIGHTS))
        return BoundLayer(g, struct, weights)

    def bind_step(self, layers: list[BoundLayer], final_norm: torch.Tensor, head: torch.Tensor,
                  eps: float) -> BoundStep:
        """Every layer (bound by bind(), in order), then the final RMSNorm (weight (hidden,)) and
        the LM head (weight (vocab, hidden), no bias), in one call per step; both weights
        contiguous CPU tensors of the layers' dtype."""
        g = layers[0].geometry
        for name, w, shape in (("final norm", final_norm, (g.hidden,)), ("LM head", head, (head.shape[0], g.hidden))):
            if not (w.dtype == g.dtype and w.device.type == "cpu" and w.is_contiguous() and tuple(w.shape) == shape):
                raise ValueError(f"decode step: the {name} must be a contiguous {g.dtype} CPU tensor of shape "
                                 f"{shape}, not {w.dtype} {tuple(w.shape)}")
        return BoundStep(self._step_fn, layers, final_norm, head, eps)

    @staticmethod
    def step(geometry: Geometry, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, slots: torch.Tensor,
             tables: torch.Tensor, seq_lens: torch.Tensor, k_cache: torch.Tensor) -> Step | None:
        """The step's rows as every layer takes them, or None where the kernel does not take this
        step (too many rows, another dtype or layout): the layers then run module by module.
        x (rows, hidden) and cos, sin (rows, 1, head_dim / 2) in geometry.dtype; slots (rows,) int64; tables
        (rows, >= pages) int32 rows contiguous; seq_lens (rows,) int32, each >= 1 and within tables;
        k_cache: the first layer's (every layer's has its shape and dtype: the layers' own, or bfloat16
        under float32 layers, paged_decode.cache_dtypes_for). The C side trusts every index:
        slots and page ids outside the caches are refused here (ValueError), never written."""
        rows = x.shape[0] if x.dim() == 2 else 0
        half = geometry.head_dim // 2
        if not (1 <= rows <= MAX_ROWS and x.dtype == geometry.dtype and x.device.type == "cpu" and x.is_contiguous()
                and x.shape[1] == geometry.hidden
                and cos.dtype == sin.dtype == x.dtype and cos.is_contiguous() and sin.is_contiguous()
                and cos.numel() == sin.numel() == rows * half
                and slots.dtype == torch.int64 and slots.shape == (rows,) and slots.is_contiguous()
                and tables.dtype == seq_lens.dtype == torch.int32 and tables.dim() == 2 and tables.shape[0] == rows
                and tables.stride(1) == 1 and seq_lens.shape == (rows,) and seq_lens.is_contiguous()
                and k_cache.dim() == 4 and k_cache.dtype in cache_dtypes_for(x.dtype)
                and 0 < k_cache.shape[1] <= MAX_PAGE_SIZE
                and tuple(k_cache.shape[2:]) == (geometry.num_kv_heads, geometry.head_dim)):
            return None
        num_pages, page_size = k_cache.shape[:2]
        (shortest, longest), (lowest_slot, highest_slot), (lowest_page, highest_page) = (
            map(int, t.aminmax()) for t in (seq_lens, slots, tables))   # one pass over each
        if shortest < 1 or longest > tables.shape[1] * page_size:
            return None
        if not (0 <= lowest_slot and highest_slot < num_pages * page_size and 0 <= lowest_page
                and highest_page < num_pages):
            raise ValueError("decode layer: a slot or page id outside the KV cache")
        args = (cos.data_ptr(), sin.data_ptr(), slots.data_ptr(), page_size, tables.data_ptr(), tables.stride(0),
                seq_lens.data_ptr())
        return Step(rows, tuple(k_cache.shape), args, (cos, sin, slots, tables, seq_lens))


class BoundLayer:
    """One layer's weights and geometry, checked once (DecodeLayerKernel.bind), for bind_step."""

    def __init__(self, geometry: Geometry, struct: LayerStruct, weights: dict) -> None:
        self.geometry, self._struct = geometry, struct
        self._weights = weights   # the memory the struct points at


class BoundStep:
    """A decode step after the embedding in one call (DecodeLayerKernel.bind_step): every layer,
    the final norm, the LM head. The caches' pointers are taken once, from the list of (k, v)
    per layer the model is called with (the KV cache's own, the same every step)."""

    def __init__(self, fn, layers: list[BoundLayer], final_norm: torch.Tensor, head: torch.Tensor,
                 eps: float) -> None:
        self._fn, self.geometry, self.vocab, self.eps = fn, layers[0].geometry, head.shape[0], eps
        self._layers = (LayerStruct * len(layers))(*(layer._struct for layer in layers))
        self._keep = (layers, final_norm, head)   # the memory the structs point at
        self._caches: list | None = None          # the list the pointers below came from
        self._struct: ModelStruct | None = None
        self._kv16 = 0                            # whether those caches are bfloat16
        self._scratch = torch.empty(self.geometry.scratch_floats(MAX_ROWS))

    def take_caches(self, kv_caches: list) -> tuple:
        """The caches' pointers from `kv_caches` where they are not this list's already; -> their
        shape (num_pages, page_size, Hk, D)."""
        if kv_caches is not self._caches:
            self._take_caches(kv_caches)
        return self._cache_shape

    def _take_caches(self, kv_caches: list) -> None:
        g, n = self.geometry, len(self._layers)
        shape = tuple(kv_caches[0][0].shape) if kv_caches else None
        dtype = kv_caches[0][0].dtype if kv_caches else None
        if len(kv_caches) != n or dtype not in cache_dtypes_for(g.dtype) or not all(
                k.dtype == v.dtype == dtype and tuple(k.shape) == tuple(v.shape) == shape
                and k.is_contiguous() and v.is_contiguous() for k, v in kv_caches):
            raise ValueError(f"decode step: {n} layers' caches, contiguous, of one shape and one dtype "
                             f"of {cache_dtypes_for(g.dtype)}")
        self._kv16 = int(dtype == torch.bfloat16)
        self._k = (ctypes.c_void_p * n)(*(k.data_ptr() for k, _ in kv_caches))
        self._v = (ctypes.c_void_p * n)(*(v.data_ptr() for _, v in kv_caches))
        final_norm, head = self._keep[1:]
        self._struct = ModelStruct(n, self.vocab, self.eps, ctypes.addressof(self._layers),
                                   ctypes.addressof(self._k), ctypes.addressof(self._v),
                                   final_norm.data_ptr(), head.data_ptr())
        self._caches, self._cache_shape = kv_caches, shape

    def __call__(self, x: torch.Tensor, step: Step, kv_caches: list) -> torch.Tensor:
        """x (rows, hidden) as step() took it (left as the last layer's output); -> logits (rows,
        vocab) float32."""
        self.take_caches(kv_caches)
        if step.cache_shape != self._cache_shape or x.dtype != self.geometry.dtype:
            raise ValueError(f"decode step: the caches must be {self._cache_shape}, x {self.geometry.dtype}")
        return self.call(x.data_ptr(), step.rows, *step.args)

    def call(self, x: int, rows: int, cos: int, sin: int, slots: int, page_size: int, tables: int, stride: int,
             lens: int) -> torch.Tensor:
        """The step on raw pointers, checked by the caller (__call__, DirectStep): -> logits (rows,
        vocab). ctypes drops the GIL for the call, as a torch op does."""
        logits = torch.empty(rows, self.vocab)
        self._fn(ctypes.byref(self._struct), x, rows, cos, sin, slots, page_size, tables, stride, lens,
                 self._scratch.data_ptr(), logits.data_ptr(), int(self.geometry.dtype == torch.bfloat16),
                 self._kv16, torch.get_num_threads())
        return logits


class DirectStep:
    """A decode step of at most MAX_ROWS sequences from plain ints, for a batch of one or a few
    where every tensor op before the native call shows in the time per token: the embedding rows
    and the RoPE angles are copied into buffers of its own and the indices into ctypes arrays,
    checked here as DecodeLayerKernel.step checks them, then BoundStep's one call. The same
    arguments reach the same C, so the logits and K/V are those of the tensor path, bit for bit."""

    max_rows = MAX_ROWS

    def __init__(self, whole: BoundStep, embedding: torch.Tensor,
                 rope_tables: Callable[[], tuple[torch.Tensor, torch.Tensor]]) -> None:
        """embedding (vocab, hidden), contiguous, of the layers' dtype; rope_tables() -> the model's
        cos, sin tables now (max_len, head_dim / 2), of that dtype (they grow: asked per step)."""
        g = whole.geometry
        if not (embedding.dtype == g.dtype and embedding.device.type == "cpu" and embedding.is_contiguous()
                and embedding.dim() == 2 and embedding.shape[1] == g.hidden):
            raise ValueError(f"direct decode step: the embedding must be a contiguous {g.dtype} CPU tensor of "
                             f"(vocab, {g.hidden}), not {embedding.dtype} {tuple(embedding.shape)}")
        self._whole, self._embedding, self._rope_tables = whole, embedding, rope_tables
        self._kv_shape = (g.num_kv_heads, g.head_dim)
        self.vocab = embedding.shape[0]
        size = embedding.element_size()
        self._row_bytes, self._half_bytes = g.hidden * size, g.head_dim // 2 * size
        self._x = torch.empty(MAX_ROWS, g.hidden, dtype=g.dtype)
        self._cos = torch.empty(MAX_ROWS, g.head_dim // 2, dtype=g.dtype)
        self._sin = torch.empty(MAX_ROWS, g.head_dim // 2, dtype=g.dtype)

    def __call__(self, ids: Sequence[int], positions: Sequence[int], slots: Sequence[int],
                 tables: Sequence[Sequence[int]], lens: Sequence[int], kv_caches: list) -> torch.Tensor | None:
        """One row per sequence: its token id, position, the cache slot its K/V go to, its page
        table and length (position + 1). -> logits (rows, vocab) float32, or None where the step
        is not this path's (too many rows, a position past the RoPE table, a length past its
        table): the tensor path takes it. An id outside the vocabulary, or a slot or page outside
        the caches, is refused (ValueError), never read or written."""
        rows = len(ids)
        if not len(positions) == len(slots) == len(tables) == len(lens) == rows:
            raise ValueError("decode step: a row without its position, slot, table or length")
        cos, sin = self._rope_tables()
        if not (1 <= rows <= MAX_ROWS and max(positions) < cos.shape[0] and cos.dtype == self._x.dtype
                and cos.is_contiguous() and sin.is_contiguous()):
            return None
        if min(positions) < 0:
            raise ValueError("decode step: a negative position")
        num_pages, page_size, *kv_shape = self._whole.take_caches(kv_caches)
        width = max(map(len, tables))
        if not (0 < page_size <= MAX_PAGE_SIZE and tuple(kv_shape) == self._kv_shape and min(lens) >= 1
                and all(n <= len(table) * page_size for n, table in zip(lens, tables))):   # each row's own table
            return None
        if min(ids) < 0 or max(ids) >= self.vocab:
            raise ValueError("decode step: a token id outside the vocabulary")
        flat = [page for table in tables for page in (*table, *(0,) * (width - len(table)))]
        if not (0 <= min(slots) and max(slots) < num_pages * page_size and 0 <= min(flat)
                and max(flat) < num_pages):
            raise ValueError("decode layer: a slot or page id outside the KV cache")
        x, c, s, e = self._x.data_ptr(), self._cos.data_ptr(), self._sin.data_ptr(), self._embedding.data_ptr()
        rb, hb, cos_at, sin_at = self._row_bytes, self._half_bytes, cos.data_ptr(), sin.data_ptr()
        move = ctypes.memmove
        for i, (token, position) in enumerate(zip(ids, positions)):
            move(x + i * rb, e + token * rb, rb)
            move(c + i * hb, cos_at + position * hb, hb)
            move(s + i * hb, sin_at + position * hb, hb)
        slots_c, lens_c = (ctypes.c_int64 * rows)(*slots), (ctypes.c_int32 * rows)(*lens)
        tables_c = (ctypes.c_int32 * len(flat))(*flat)
        return self._whole.call(x, rows, c, s, ctypes.addressof(slots_c), page_size, ctypes.addressof(tables_c),
                                width, ctypes.addressof(lens_c))


def _load() -> DecodeLayerKernel:
    return DecodeLayerKernel(*load_library("decode_layer", "a CPU it was built for"))


load = once_per_process(_load)
