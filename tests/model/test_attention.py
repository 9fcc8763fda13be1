"""Attention backends against a naive reference, and backend selection.

The reference loops over every query row and attends to keys 0 .. its position
on its sequence's pages, repeating K/V heads the plain way: slow and obvious.
"""

from __future__ import annotations

import sys

import pytest
import torch

from kvserve.model_service.attention import flash_attn_backend
from kvserve.model_service.attention.decode import decode_groups
from kvserve.model_service.attention.flash_attn_backend import FlashApi, FlashAttnBackend
from kvserve.model_service.attention.paged import PagedAttention
from kvserve.model_service.attention.select import cpu_attention, select_backend, torch_attention
from kvserve.model_service.batch import ForwardBatch
from kvserve.model_service.kernels import cpu_gemm, paged_decode
from kvserve.model_service.kernels.onednn import onednn_available
from tests.model.native_kernels import load_or_skip, why_not

H, HK, D, PAGE, PAGES = 8, 2, 16, 4, 64


def make_batch(query_lens: list[int], seq_lens: list[int], num_decodes: int, seed: int = 0,
               page_size: int = PAGE, pages: int = PAGES, device: str = "cpu") -> ForwardBatch:
    """Each sequence on pages drawn at random from the pool, its last query_len tokens the step's."""
    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(pages, generator=g).tolist()
    tables, slots, positions = [], [], []
    for q_len, s_len in zip(query_lens, seq_lens):
        n = -(-s_len // page_size)
        table, perm = perm[:n], perm[n:]
        tables.append(table)
        for p in range(s_len - q_len, s_len):
            slots.append(table[p // page_size] * page_size + p % page_size)
            positions.append(p)
    width = max(map(len, tables))
    cu = torch.tensor([0] + query_lens).cumsum(0).to(torch.int32)
    return ForwardBatch(
        input_ids=torch.zeros(sum(query_lens), dtype=torch.int64, device=device),
        positions=torch.tensor(positions, device=device), slot_mapping=torch.tensor(slots, device=device),
        cu_seqlens_q=cu.to(device), seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32, device=device),
        logits_indices=(cu[1:].long() - 1).to(device), num_decodes=num_decodes,
        max_seqlen_q=max(query_lens), max_seqlen_k=max(seq_lens),
        query_lens_cpu=query_lens, seq_lens_cpu=seq_lens)


def reference(q, k_cache, v_cache, batch: ForwardBatch, scale: float) -> torch.Tensor:
    out = torch.empty(q.shape, dtype=torch.float32)
    flat_k = k_cache.reshape(-1, HK, D).float().repeat_interleave(H // HK, dim=1)   # (slots, H, D)
    flat_v = v_cache.reshape(-1, HK, D).float().repeat_interleave(H // HK, dim=1)
    for row in range(q.shape[0]):
        seq = int(torch.searchsorted(batch.cu_seqlens_q, row, right=True)) - 1
        pos = int(batch.positions[row])
        table = batch.block_tables[seq].long()
        slots = table[torch.arange(pos + 1) // PAGE] * PAGE + torch.arange(pos + 1) % PAGE
        scores = torch.einsum("hd,shd->hs", q[row].float(), flat_k[slots]) * scale     # (H, S)
        out[row] = torch.einsum("hs,shd->hd", scores.softmax(-1), flat_v[slots])
    return out


def random_qkv(t: int, dtype=torch.float32, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(t, H, D, generator=g).to(dtype)
    k = torch.randn(t, HK, D, generator=g).to(dtype)
    v = torch.randn(t, HK, D, generator=g).to(dtype)
    k_cache = torch.randn(PAGES, PAGE, HK, D, generator=g).to(dtype)   # stale bytes everywhere
    v_cache = torch.randn(PAGES, PAGE, HK, D, generator=g).to(dtype)
    return q, k, v, k_cache, v_cache


CASES = {
    "decode only": ([1, 1, 1], [5, 17, 9], 3),
    "prefill only, nothing cached": ([7, 12], [7, 12], 0),
    "mixed: 3 decodes, a cached chunk, a fresh chunk": ([1, 1, 1, 6, 5], [3, 20, 8, 15, 5], 3),
    # 20 decodes: two length groups (decode_groups), masks inside each
    "many decodes of mixed lengths": ([1] * 20, [(7 * i) % 12 + 1 for i in range(20)], 20),
    # 24 decodes longest first, as the scheduler sends them: three groups that are row ranges
    "many decodes, longest first, and a chunk": ([1] * 24 + [4], sorted(((5 * i) % 12 + 2 for i in range(24)),
                                                                     reverse=True) + [7], 24),
    # 16 decodes of two lengths: each group all one length, so no mask at all
    "two groups of equal lengths, and a chunk": ([1] * 16 + [3], [9, 4] * 8 + [6], 16),
    # 70 queries behind 100 cached keys: on CPU with oneDNN, the matmul path (MATMUL_MIN_QUERIES)
    "a decode, and a long chunk behind a cached prefix": ([1, 70], [9, 170], 1),
}


def kernel_or_skip() -> paged_decode.PagedDecodeKernel:
    return load_or_skip(paged_decode.load, "the cpu backend's kernel")


def gemm_or_skip() -> cpu_gemm.CpuGemm:
    return load_or_skip(cpu_gemm.load, "the native GEMM")


class CountingGemm:
    """A native GEMM that counts its products: the test sees that the path it means ran."""

    def __init__(self, gemm: cpu_gemm.CpuGemm) -> None:
        self.gemm, self.calls = gemm, 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self.gemm(*args, **kwargs)

    def __getattr__(self, name: str):
        return getattr(self.gemm, name)


class CountingCausal:
    """The cpu backend's causal kernel, its calls and how many of them it took (not None)."""

    def __init__(self, causal) -> None:
        self.causal, self.calls, self.taken = causal, 0, 0

    def __call__(self, *args):
        self.calls += 1
        out = self.causal(*args)
        self.taken += out is not None
        return out


def make_backend(name: str) -> PagedAttention:
    """torch; cpu (its prefill chunks through the native causal kernel where built, else the
    matmul path's products on oneDNN); cpu+gemm (without the causal kernel: cached-prefix chunks'
    products on the native GEMM, as select_backend builds it where that runs)."""
    if name == "cpu":
        backend = cpu_attention(kernel_or_skip())
        backend.chunks.causal = CountingCausal(backend.chunks.causal)
        return backend
    if name == "cpu+gemm":
        backend = cpu_attention(kernel_or_skip(), CountingGemm(gemm_or_skip()))
        backend.chunks.causal = lambda *args: None   # the matmul path, as on a CPU without the kernel
        return backend
    return torch_attention()


@pytest.mark.parametrize("name", ["torch", "cpu", "cpu+gemm"])
@pytest.mark.parametrize("case", CASES)
def test_cpu_backends_match_reference(case: str, name: str) -> None:
    query_lens, seq_lens, num_decodes = CASES[case]
    batch = make_batch(query_lens, seq_lens, num_decodes)
    q, k, v, k_cache, v_cache = random_qkv(sum(query_lens))
    backend = make_backend(name)
    meta = backend.prepare(batch)
    out = backend.forward(q, k, v, k_cache, v_cache, meta, scale=0.3)
    if name == "cpu+gemm":   # 2 products per KV head for each chunk on the matmul path
        matmul_chunks = sum(chunk.matmul for chunk in meta.prefills)
        assert backend.chunks.gemm.calls == 2 * HK * matmul_chunks
        assert matmul_chunks == (case == "a decode, and a long chunk behind a cached prefix")
    if name == "cpu":   # every prefill chunk offered to the causal kernel; taken where it is built
        causal = backend.chunks.causal
        assert causal.calls == len(meta.prefills)
        assert causal.taken in (0, causal.calls)
    # The step's K/V landed at their slots.
    assert torch.equal(k_cache.view(-1, HK, D)[batch.slot_mapping], k)
    assert torch.equal(v_cache.view(-1, HK, D)[batch.slot_mapping], v)
    torch.testing.assert_close(out, reference(q, k_cache, v_cache, batch, 0.3), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ["torch", "cpu", "cpu+gemm"])
@pytest.mark.parametrize("case", CASES)
def test_float32_queries_over_bfloat16_pages(case: str, name: str) -> None:
    """--kv-cache-dtype bfloat16 under a float32 model: the step's K/V are written rounded once,
    and every path (decode kernel, gathered SDPA, cached-prefix matmul) attends to exactly the
    values the pages hold, widened: the float32 reference over those values."""
    query_lens, seq_lens, num_decodes = CASES[case]
    batch = make_batch(query_lens, seq_lens, num_decodes)
    q, k, v, k_cache, v_cache = random_qkv(sum(query_lens))
    k_cache, v_cache = k_cache.bfloat16(), v_cache.bfloat16()
    backend = make_backend(name)
    out = backend.forward(q, k, v, k_cache, v_cache, backend.prepare(batch), scale=0.3)
    assert out.dtype == torch.float32 and k_cache.dtype == torch.bfloat16
    assert torch.equal(k_cache.view(-1, HK, D)[batch.slot_mapping], k.bfloat16())
    assert torch.equal(v_cache.view(-1, HK, D)[batch.slot_mapping], v.bfloat16())
    torch.testing.assert_close(out, reference(q, k_cache, v_cache, batch, 0.3), rtol=1e-5, atol=1e-5)


def test_only_mid_sized_cached_chunks_take_the_onednn_matmul_path() -> None:
    if not onednn_available(torch.float32):
        pytest.skip("oneDNN linears do not run here")
    backend = torch_attention()
    chunks = backend.prepare(make_batch([1, 70, 8, 12], [9, 170, 20, 12], 1)).prefills
    assert [c.masked for c in chunks] == [True, True, False]               # the last: nothing cached
    assert all(c.mask is None for c in chunks)                             # built only where a path asks
    masks = [backend.chunk_mask(c) if c.masked else (None, None) for c in chunks]
    assert [bias is not None for _, bias in masks] == [True, False, False]   # short chunk; nothing cached
    mask, bias = masks[0]
    assert torch.equal(bias == 0, mask) and torch.isneginf(bias[~mask]).all()
    assert backend.chunk_mask(chunks[0])[0] is mask                        # once a step, for every layer


def test_decode_groups_split_rows_by_context_length_longest_first() -> None:
    assert decode_groups([5, 9, 2]) == [[0, 1, 2]]            # too few rows to be worth splitting
    lens = [10, 40, 20, 30] * 4                                 # 16 rows: two groups of 8
    assert decode_groups(lens) == [[1, 5, 9, 13, 3, 7, 11, 15], [2, 6, 10, 14, 0, 4, 8, 12]]
    groups = decode_groups(list(range(64)))                     # at most four groups
    assert [len(g) for g in groups] == [16] * 4 and groups[0][0] == 63 and groups[-1][-1] == 0


def test_decodes_in_length_order_are_sliced_not_indexed() -> None:
    lens = sorted(((5 * i) % 12 + 2 for i in range(24)), reverse=True)
    meta = torch_attention().prepare(make_batch([1] * 24, lens, 24))
    assert [g.rows for g in meta.decode] == [slice(0, 8), slice(8, 16), slice(16, 24)]
    meta = torch_attention().prepare(make_batch([1] * 24, lens[::-1], 24))
    assert all(isinstance(g.rows, torch.Tensor) for g in meta.decode)


def windowed_reference(q, k_cache, v_cache, batch: ForwardBatch, scale: float, window: int,
                       sinks: int) -> torch.Tensor:
    """A query row at position p attends keys p - window + 1 .. p and the first `sinks`."""
    flat_k = k_cache.reshape(-1, HK, D).repeat_interleave(H // HK, dim=1)
    flat_v = v_cache.reshape(-1, HK, D).repeat_interleave(H // HK, dim=1)
    out = torch.empty_like(q)
    for row in range(q.shape[0]):
        seq = int(torch.searchsorted(batch.cu_seqlens_q, row, right=True)) - 1
        pos = int(batch.positions[row])
        keys = torch.tensor([k for k in range(pos + 1) if k > pos - window or k < sinks])
        slots = batch.block_tables[seq].long()[keys // PAGE] * PAGE + keys % PAGE
        scores = torch.einsum("hd,shd->hs", q[row], flat_k[slots]) * scale
        out[row] = torch.einsum("hs,shd->hd", scores.softmax(-1), flat_v[slots])
    return out


WINDOW_CASES = {   # decode lengths
    "one long stream beside short ones": [203, 5, 9, 14, 3, 31],
    "lengths close together": [40, 38, 41, 39],
    "a long stream in the first of two groups": [190] + [12 + (5 * i) % 17 for i in range(17)],
}


@pytest.mark.parametrize("sinks", [0, 1, 6])
@pytest.mark.parametrize("case", WINDOW_CASES)
def test_windowed_decodes_match_reference(case: str, sinks: int) -> None:
    """The torch backend's decode under a sliding window (and sinks): a group of lengths far apart
    gathers each row's own window instead of every page from the shortest window's on: no group
    gathers more keys than one row's sinks and window span."""
    lens = WINDOW_CASES[case]
    pages = sum(-(-n // PAGE) for n in lens)
    batch = make_batch([1] * len(lens), lens, len(lens), pages=pages)
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(len(lens), h, D, generator=g) for h in (H, HK, HK))
    k_cache, v_cache = (torch.randn(pages, PAGE, HK, D, generator=g) for _ in range(2))
    backend = torch_attention()
    window = 10
    backend.set_window(window, sinks, PAGE)
    meta = backend.prepare(batch)
    out = backend.forward(q, k, v, k_cache, v_cache, meta, scale=0.3)
    own = -(-sinks // PAGE) + -(-(window - 1) // PAGE) + 1
    assert max(group.length for group in meta.decode) <= own * PAGE
    torch.testing.assert_close(out, windowed_reference(q, k_cache, v_cache, batch, 0.3, window, sinks),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("sinks", [0, 1, 6])
def test_windowed_chunks_gather_only_their_windows_and_match_reference(sinks: int) -> None:
    """A chunk far past the window (a long prompt's later chunk, a stream with sinks recomputed
    after a preemption) gathers the sinks' pages and those from its first query's window on."""
    query_lens, seq_lens = [1, 1, 6, 13, 70], [90, 7, 120, 40, 150]
    pages = sum(-(-n // PAGE) for n in seq_lens)
    batch = make_batch(query_lens, seq_lens, 2, pages=pages)
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(sum(query_lens), h, D, generator=g) for h in (H, HK, HK))
    k_cache, v_cache = (torch.randn(pages, PAGE, HK, D, generator=g) for _ in range(2))
    backend, window = torch_attention(), 10
    backend.set_window(window, sinks, PAGE)
    meta = backend.prepare(batch)
    out = backend.forward(q, k, v, k_cache, v_cache, meta, scale=0.3)
    sink_keys = -(-sinks // PAGE) * PAGE
    for chunk, q_len in zip(meta.prefills, query_lens[2:]):
        assert chunk.keys <= sink_keys + q_len + window - 1 + 2 * PAGE
    assert meta.prefills[0].key_positions is not None   # 114 keys cached before its 6 queries
    torch.testing.assert_close(out, windowed_reference(q, k_cache, v_cache, batch, 0.3, window, sinks),
                               rtol=1e-5, atol=1e-5)


def fake_flash_api(version: int, calls: list[str]) -> FlashApi:
    """flash-attn's documented contracts, computed by the reference (bottom-right causal)."""
    def varlen(q, k_cache, v_cache, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None,
               max_seqlen_k=None, softmax_scale=None, causal=False, block_table=None,
               seqused_k=None, page_table=None):
        assert causal
        calls.append("varlen")
        tables = block_table if version == 2 else page_table
        lens = cu_seqlens_k.diff() if version == 2 else seqused_k
        assert tables.dtype == lens.dtype == cu_seqlens_q.dtype == torch.int32
        out = reference(q, k_cache, v_cache, batch_from(cu_seqlens_q, lens, tables), softmax_scale)
        out = out.to(q.dtype)
        return (out, None) if version == 4 else out

    def with_kvcache(q, k_cache, v_cache, cache_seqlens=None, block_table=None, softmax_scale=None,
                     causal=False):
        calls.append("with_kvcache")
        b = q.shape[0]
        cu = torch.arange(b + 1, dtype=torch.int32)
        out = reference(q[:, 0], k_cache, v_cache, batch_from(cu, cache_seqlens, block_table), softmax_scale)
        return out.to(q.dtype)[:, None]

    return FlashApi(version, varlen, with_kvcache if version == 2 else None)


def batch_from(cu_q: torch.Tensor, seq_lens: torch.Tensor, tables: torch.Tensor) -> ForwardBatch:
    q_lens = cu_q.diff().tolist()
    positions = torch.cat([torch.arange(s - n, s) for n, s in zip(q_lens, seq_lens.tolist())])
    return ForwardBatch(positions, positions, positions, cu_q, seq_lens, tables, positions, 0,
                        max(q_lens), int(seq_lens.max()), q_lens, seq_lens.tolist())


@pytest.mark.parametrize("version", [2, 4])
@pytest.mark.parametrize("case", CASES)
def test_flash_backend_passes_flash_attn_what_it_expects(monkeypatch, version: int, case: str) -> None:
    calls: list[str] = []
    monkeypatch.setattr(flash_attn_backend, "load_flash_api", lambda: fake_flash_api(version, calls))
    monkeypatch.setattr(flash_attn_backend, "fa4_unfit", lambda device=None: None)
    backend = FlashAttnBackend()
    assert backend.page_size_multiple() == (256 if version == 2 else 1)
    assert backend.default_page_size() == (256 if version == 2 else 128)
    query_lens, seq_lens, num_decodes = CASES[case]
    batch = make_batch(query_lens, seq_lens, num_decodes)
    q, k, v, k_cache, v_cache = random_qkv(sum(query_lens), torch.bfloat16)
    out = backend.forward(q, k, v, k_cache, v_cache, backend.prepare(batch), scale=0.3)
    decode_only = num_decodes == len(query_lens)
    expected_call = "with_kvcache" if version == 2 and decode_only else "varlen"
    assert calls == [expected_call]
    torch.testing.assert_close(out.float(), reference(q, k_cache, v_cache, batch, 0.3), rtol=2e-2, atol=2e-2)
    with pytest.raises(RuntimeError, match="float16 or bfloat16"):
        backend.forward(*[t.float() for t in (q, k, v, k_cache, v_cache)], backend.prepare(batch), 0.3)


def test_flash_backend_module_imports_without_flash_attn_and_refuses_to_start(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "flash_attn", None)     # import flash_attn -> ImportError
    assert flash_attn_backend.load_flash_api() is None
    with pytest.raises(RuntimeError, match="flash-attn 2.*flash-attn 4.*torch backend"):
        FlashAttnBackend()


def test_select_backend(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "flash_attn", None)
    assert select_backend("torch", "cpu").name == "torch"
    assert select_backend("auto", "cuda").name == "torch"       # no flash-attn here
    with pytest.raises(RuntimeError, match="CUDA only"):
        select_backend("flash_attn", "cpu")
    with pytest.raises(ValueError, match="auto, torch, cpu, flash_attn"):
        select_backend("xformers", "cpu")


def test_select_cpu_backend_where_its_kernel_runs() -> None:
    kernel_or_skip()
    assert select_backend("auto", "cpu").name == "cpu"
    assert select_backend("auto", "cpu", page_size=16, dtype=torch.float32).name == "cpu"
    assert select_backend("cpu", "cpu").name == "cpu"
    # auto falls back to torch where the kernel does not apply; asked for by name, it refuses.
    assert select_backend("auto", "cpu", dtype=torch.bfloat16).name == "cpu"
    assert select_backend("auto", "cpu", dtype=torch.float16).name == "torch"
    assert select_backend("auto", "cpu", page_size=512).name == "torch"
    with pytest.raises(RuntimeError, match="float32 and bfloat16, not torch.float16"):
        select_backend("cpu", "cpu", dtype=torch.float16)
    with pytest.raises(RuntimeError, match="at most 256"):
        select_backend("cpu", "cpu", page_size=512)
    assert select_backend("auto", "cpu", head_floats=64 * 512).name == "torch"
    with pytest.raises(RuntimeError, match="up to 16384, not 32768"):
        select_backend("cpu", "cpu", head_floats=64 * 512)
    with pytest.raises(RuntimeError, match="CPU only"):
        select_backend("cpu", "cuda")
    # A chat turn's chunk products run on the native GEMM only when the model's matmuls do.
    assert select_backend("cpu", "cpu", gemm="onednn").chunks.gemm is None
    assert select_backend("cpu", "cpu", gemm="torch").chunks.gemm is None
    assert (select_backend("cpu", "cpu", gemm="native").chunks.gemm is None) == (why_not(cpu_gemm.load) is not None)


def test_auto_falls_back_to_torch_when_the_kernel_cannot_load(monkeypatch) -> None:
    from kvserve.model_service.attention import select

    def unavailable():
        raise paged_decode.KernelUnavailable("the paged_decode kernel was not built for this CPU")

    monkeypatch.setattr(select.paged_decode, "load", unavailable)
    assert select_backend("auto", "cpu").name == "torch"
    with pytest.raises(RuntimeError, match="kernel is unavailable: the paged_decode kernel was not built"):
        select_backend("cpu", "cpu")


def test_flash_attn_4_is_refused_on_a_gpu_whose_paged_kernels_it_lacks(monkeypatch) -> None:
    from kvserve.model_service.attention import select

    for module in (select, flash_attn_backend):
        monkeypatch.setattr(module, "load_flash_api", lambda: fake_flash_api(4, []))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for major, ok in ((8, False), (9, True), (10, True), (12, False)):   # Ampere, Hopper, Blackwell, RTX 50
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None, m=major: (m, 0))
        assert select_backend("auto", "cuda").name == ("flash_attn" if ok else "torch")
        if not ok:
            with pytest.raises(RuntimeError, match="Hopper and Blackwell"):
                select_backend("flash_attn", "cuda")


def test_auto_picks_flash_on_cuda_when_it_imports_and_fits_the_page_size(monkeypatch) -> None:
    from kvserve.model_service.attention import select

    monkeypatch.setattr(select, "load_flash_api", lambda: fake_flash_api(2, []))
    monkeypatch.setattr(flash_attn_backend, "load_flash_api", lambda: fake_flash_api(2, []))
    assert select_backend("auto", "cuda").name == "flash_attn"
    assert select_backend("auto", "cuda", page_size=512).name == "flash_attn"
    assert select_backend("auto", "cuda", page_size=16).name == "torch"    # FA2 wants % 256
    assert select_backend("auto", "cpu").name in ("cpu", "torch")          # never flash_attn


def test_torch_backend_works_in_and_out_of_inference_mode() -> None:
    """Its reused gather buffers must not become inference tensors (the engine runs the model
    under inference_mode; tests and tools may not)."""
    query_lens, seq_lens, num_decodes = CASES["mixed: 3 decodes, a cached chunk, a fresh chunk"]
    batch = make_batch(query_lens, seq_lens, num_decodes)
    q, k, v, k_cache, v_cache = random_qkv(sum(query_lens))
    backend = torch_attention()
    with torch.inference_mode():
        inside = backend.forward(q, k, v, k_cache, v_cache, backend.prepare(batch), scale=0.3)
    outside = backend.forward(q, k, v, k_cache, v_cache, backend.prepare(batch), scale=0.3)
    torch.testing.assert_close(inside, outside, rtol=0, atol=0)


def test_flash_attn_4_before_the_verified_release_is_refused(monkeypatch) -> None:
    import importlib.metadata

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "4.0.0b20")
    assert "predates 4.0.0b36" in flash_attn_backend.fa4_unfit("cuda")
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "4.0.1")
    assert flash_attn_backend.fa4_unfit("cuda") is None
