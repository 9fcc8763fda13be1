"""The native paged decode kernel (kernels/paged_decode.c) against a reference."""

from __future__ import annotations


import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve.model_service.kernels import paged_decode
from tests.model.native_kernels import load_at_level, runnable_levels, torch_threads


@pytest.fixture(scope="module", params=runnable_levels("paged_decode"))
def kernel(request) -> paged_decode.PagedDecodeKernel:
    return load_at_level(paged_decode._load, request.param, "the paged decode kernel")


def reference(q, k_cache, v_cache, tables, seq_lens, scale) -> torch.Tensor:
    """Per sequence: its keys slot by slot through its page table, softmax in float64."""
    n, h, d = q.shape
    page, hk = k_cache.shape[1], k_cache.shape[2]
    out = torch.empty(n, h, d, dtype=torch.float64)
    for s in range(n):
        pos = torch.arange(int(seq_lens[s]))
        pages = tables[s].long()[pos // page]
        keys = k_cache[pages, pos % page].double().repeat_interleave(h // hk, dim=1)     # (L, H, D)
        values = v_cache[pages, pos % page].double().repeat_interleave(h // hk, dim=1)
        scores = torch.einsum("hd,lhd->hl", q[s].double(), keys) * scale
        out[s] = torch.einsum("hl,lhd->hd", scores.softmax(-1), values)
    return out


def random_case(seed, num_kv_heads, group, head_dim, page_size, lens, extra_columns, magnitude=1.0):
    g = torch.Generator().manual_seed(seed)
    h = num_kv_heads * group
    need = [-(-n // page_size) for n in lens]
    num_pages = sum(need) + 3
    k_cache = torch.randn(num_pages, page_size, num_kv_heads, head_dim, generator=g)
    v_cache = torch.randn(num_pages, page_size, num_kv_heads, head_dim, generator=g)
    perm = torch.randperm(num_pages, generator=g).tolist()
    width = max(need) + extra_columns
    rows = []
    for n in need:
        rows.append(perm[:n] + [0] * (width - n))
        perm = perm[n:]
    tables = torch.tensor(rows, dtype=torch.int32)
    q = torch.randn(len(lens), h, head_dim, generator=g) * magnitude
    return q, k_cache, v_cache, tables, torch.tensor(lens, dtype=torch.int32)


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**16), num_kv_heads=st.sampled_from([1, 2, 4]), group=st.sampled_from([1, 2, 4, 8]),
       head_dim=st.sampled_from([8, 16, 64, 80, 128]), page_size=st.sampled_from([1, 3, 4, 16, 32]),
       lens=st.lists(st.integers(1, 150), min_size=1, max_size=6), extra_columns=st.integers(0, 3),
       threads=st.sampled_from([1, 2, 3, 4]))
def test_kernel_matches_reference(kernel, seed, num_kv_heads, group, head_dim, page_size, lens,
                                  extra_columns, threads) -> None:
    q, k_cache, v_cache, tables, seq_lens = random_case(seed, num_kv_heads, group, head_dim, page_size,
                                                        lens, extra_columns)
    with torch_threads(threads):
        out = kernel(q, k_cache, v_cache, tables, seq_lens, scale=head_dim ** -0.5, max_len=max(lens))
    expected = reference(q, k_cache, v_cache, tables, seq_lens, head_dim ** -0.5)
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("threads", [2, 3, 8])
@pytest.mark.parametrize("num_kv_heads", [1, 2, 3, 8])
def test_one_sequence_split_by_kv_head(kernel, threads, num_kv_heads) -> None:
    """Fewer sequences than threads: a sequence's KV heads are shared out between tasks (no
    head attended twice or left out, whatever the split's remainder)."""
    q, k_cache, v_cache, tables, seq_lens = random_case(3, num_kv_heads, 2, 64, 16, [200], 0)
    with torch_threads(threads):
        out = kernel(q, k_cache, v_cache, tables, seq_lens, scale=0.125, max_len=200)
    torch.testing.assert_close(out.double(), reference(q, k_cache, v_cache, tables, seq_lens, 0.125),
                               rtol=1e-5, atol=1e-5)


def test_large_scores_do_not_overflow(kernel) -> None:
    """Scores in the thousands: the online softmax must rescale, never exponentiate them raw."""
    q, k_cache, v_cache, tables, seq_lens = random_case(7, 2, 4, 64, 16, [1, 40, 300], 1, magnitude=200.0)
    out = kernel(q, k_cache, v_cache, tables, seq_lens, scale=0.125, max_len=300)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), reference(q, k_cache, v_cache, tables, seq_lens, 0.125),
                               rtol=1e-4, atol=1e-4)


def test_a_row_view_of_the_tables_and_queries_is_read_right(kernel) -> None:
    """The backend passes the decode rows of wider tensors: a row slice, queries not contiguous."""
    q, k_cache, v_cache, tables, seq_lens = random_case(3, 2, 2, 16, 4, [9, 30, 2, 17], 2)
    wide_q = torch.cat([q, q], dim=2)[:, :, :16]             # strided view, same values
    out = kernel(wide_q[1:3], k_cache, v_cache, tables[1:3], seq_lens[1:3], scale=0.25, max_len=30)
    expected = reference(q[1:3], k_cache, v_cache, tables[1:3], seq_lens[1:3], 0.25)
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)
    # What would read past the tables is refused: more queries than rows, a context longer than a row.
    with pytest.raises(ValueError, match="inconsistent"):
        kernel(wide_q, k_cache, v_cache, tables[1:3], seq_lens[1:3], scale=0.25, max_len=30)
    with pytest.raises(ValueError, match="inconsistent"):
        kernel(wide_q[1:3], k_cache, v_cache, tables[1:3, :2], seq_lens[1:3], scale=0.25, max_len=30)


@settings(max_examples=40, deadline=None)
@given(group=st.integers(1, 8), chunk=st.integers(1, 40), cached=st.integers(0, 100),
       scale=st.floats(0.01, 2.0), magnitude=st.sampled_from([1.0, 50.0]), seed=st.integers(0, 2**16))
def test_chunk_softmax_matches_the_masked_torch_softmax(kernel, group, chunk, cached, scale, magnitude, seed) -> None:
    """Row r is query r % chunk of one of `group` query heads; it sees cached + r % chunk + 1
    keys. Large scores must not overflow."""
    g = torch.Generator().manual_seed(seed)
    scores = torch.randn(group * chunk, cached + chunk, generator=g) * magnitude
    seen = torch.arange(cached + chunk)[None, :] <= cached + torch.arange(chunk)[:, None]   # (chunk, S)
    mask = seen.repeat(group, 1)
    expected = torch.softmax((scores.double() * scale).masked_fill(~mask, float("-inf")), dim=-1)
    got = kernel.chunk_softmax(scores, chunk, cached, scale)
    assert got.data_ptr() == scores.data_ptr()
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-6)
    assert (got[~mask] == 0).all()


def test_chunk_softmax_refuses_inconsistent_calls(kernel) -> None:
    bad = [
        (torch.randn(8, 30), 4, 20, 0.1),          # cols != cached + chunk
        (torch.randn(9, 24), 4, 20, 0.1),          # rows not a multiple of chunk
        (torch.randn(8, 24).double(), 4, 20, 0.1),
        (torch.randn(24, 8).t(), 4, 20, 0.1),      # not contiguous
        (torch.randn(8, 24), 4, 20, 0.0),          # scale must be > 0
    ]
    for scores, chunk, cached, scale in bad:
        with pytest.raises(ValueError):
            kernel.chunk_softmax(scores, chunk, cached, scale)


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**16), num_kv_heads=st.sampled_from([1, 2, 4]), group=st.sampled_from([1, 4]),
       head_dim=st.sampled_from([16, 64, 80, 128]), page_size=st.sampled_from([3, 16]),
       lens=st.lists(st.integers(1, 150), min_size=1, max_size=4), threads=st.sampled_from([1, 2]))
def test_bfloat16_within_one_rounding_of_the_exact_result(kernel, seed, num_kv_heads, group, head_dim,
                                                         page_size, lens, threads) -> None:
    """bfloat16 q and caches: sums in float32, the output rounded once, so it lies within one
    bfloat16 step of the exact attention of the same bfloat16 inputs."""
    q, k_cache, v_cache, tables, seq_lens = random_case(seed, num_kv_heads, group, head_dim, page_size, lens, 1)
    q, k_cache, v_cache = q.bfloat16(), k_cache.bfloat16(), v_cache.bfloat16()
    with torch_threads(threads):
        out = kernel(q, k_cache, v_cache, tables, seq_lens, scale=head_dim ** -0.5, max_len=max(lens))
    assert out.dtype == torch.bfloat16
    exact = reference(q, k_cache, v_cache, tables, seq_lens, head_dim ** -0.5)
    step = exact.abs().clamp_min(2.0 ** -126) * 2.0 ** -8          # one bfloat16 ulp at most
    assert ((out.double() - exact).abs() <= step + 1e-6).all()


def test_bfloat16_refuses_mixed_dtypes(kernel) -> None:
    q, k_cache, v_cache, tables, seq_lens = random_case(1, 2, 2, 64, 16, [20], 0)
    with pytest.raises(ValueError, match="inconsistent"):
        kernel(q.bfloat16(), k_cache, v_cache, tables, seq_lens, scale=0.125, max_len=20)
    with pytest.raises(ValueError, match="inconsistent"):   # the two caches of one dtype
        kernel(q, k_cache.bfloat16(), v_cache, tables, seq_lens, scale=0.125, max_len=20)


def test_lengths_and_page_ids_outside_the_cache_are_refused_and_no_sequence_is_nothing(kernel) -> None:
    """The C side reads where they say: a page id past the pool or a length past the table was a
    segfault, a length of 0 NaN, and no sequence at all divided by zero (SIGFPE)."""
    q, k_cache, v_cache, tables, seq_lens = random_case(1, 2, 2, 64, 16, [20], 0)
    assert kernel(q[:0], k_cache, v_cache, tables[:0], seq_lens[:0], scale=0.125, max_len=0).shape == (0, 4, 64)
    num_pages, width = k_cache.shape[0], tables.shape[1] * k_cache.shape[1]
    for bad_tables, bad_lens in ((torch.full_like(tables, num_pages), seq_lens), (tables, seq_lens * 0),
                                 (tables, torch.full_like(seq_lens, width + 1)), (tables - 1000, seq_lens)):
        with pytest.raises(ValueError, match="outside the tables or the KV cache"):
            kernel(q, k_cache, v_cache, bad_tables.contiguous(), bad_lens.contiguous(), scale=0.125, max_len=20)


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**16), num_kv_heads=st.sampled_from([1, 2, 4]), group=st.sampled_from([1, 2, 4, 8]),
       head_dim=st.sampled_from([8, 16, 64, 80, 128]), page_size=st.sampled_from([1, 3, 16, 32]),
       lens=st.lists(st.integers(1, 150), min_size=1, max_size=6), threads=st.sampled_from([1, 2, 3]))
def test_float32_queries_over_bfloat16_pages(kernel, seed, num_kv_heads, group, head_dim, page_size, lens,
                                             threads) -> None:
    """--kv-cache-dtype bfloat16 under a float32 model: the pages are widened as read and every
    sum is float32, so the float32 output is the exact attention of those bfloat16 values, as the
    float32 kernel's is of float32 ones."""
    q, k_cache, v_cache, tables, seq_lens = random_case(seed, num_kv_heads, group, head_dim, page_size, lens, 1)
    k16, v16 = k_cache.bfloat16(), v_cache.bfloat16()
    with torch_threads(threads):
        out = kernel(q, k16, v16, tables, seq_lens, scale=head_dim ** -0.5, max_len=max(lens))
    assert out.dtype == torch.float32
    expected = reference(q, k16, v16, tables, seq_lens, head_dim ** -0.5)
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)
    # and it is the float32 kernel's answer over the same values widened ahead of time
    with torch_threads(threads):
        widened = kernel(q, k16.float(), v16.float(), tables, seq_lens, scale=head_dim ** -0.5, max_len=max(lens))
    torch.testing.assert_close(out, widened, rtol=1e-6, atol=1e-6)


def causal_reference(q, keys, values, cached, scale) -> torch.Tensor:
    """Query i at position cached + i over keys 0 .. cached + i, softmax in float64."""
    length, h, d = q.shape
    hk = keys.shape[1]
    k = keys.double().repeat_interleave(h // hk, dim=1)        # (S, H, D)
    v = values.double().repeat_interleave(h // hk, dim=1)
    scores = torch.einsum("lhd,shd->hls", q.double(), k) * scale
    seen = torch.arange(keys.shape[0])[None, :] <= (cached + torch.arange(length))[:, None]   # (L, S)
    scores = scores.masked_fill(~seen, float("-inf"))
    return torch.einsum("hls,shd->lhd", scores.softmax(-1), v)


def causal_built(kernel) -> bool:
    return kernel.level == "avx512"


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**16), length=st.integers(1, 70), cached=st.sampled_from([0, 0, 1, 15, 16, 37, 130]),
       num_kv_heads=st.sampled_from([1, 2, 4]), group=st.sampled_from([1, 2, 4]),
       head_dim=st.sampled_from([16, 32, 48, 64, 80, 96, 112, 128, 256, 512]), threads=st.sampled_from([1, 2, 3]),
       magnitude=st.sampled_from([1.0, 30.0]))
def test_causal_attention_matches_the_masked_softmax(kernel, seed, length, cached, num_kv_heads, group, head_dim,
                                                     threads, magnitude) -> None:
    """A prefill chunk's causal attention (fresh, or behind cached keys), queries taken from a
    wider row (as from the fused qkv projection), large scores included."""
    g = torch.Generator().manual_seed(seed)
    h, s = num_kv_heads * group, cached + length
    fused = torch.randn(length, (h + 2) * head_dim, generator=g) * magnitude
    q = fused[:, :h * head_dim].view(length, h, head_dim)           # rows (h + 2) * head_dim apart
    keys = torch.randn(s, num_kv_heads, head_dim, generator=g)
    values = torch.randn(s, num_kv_heads, head_dim, generator=g)
    with torch_threads(threads):
        out = kernel.causal_attention(q, keys, values, cached, head_dim ** -0.5)
    if not causal_built(kernel):
        assert out is None
        return
    expected = causal_reference(q, keys, values, cached, head_dim ** -0.5)
    # scores of ~magnitude x N(0, 1): float32's rounding of them grows with it
    torch.testing.assert_close(out.double(), expected, rtol=1e-5 * magnitude, atol=1e-5 * magnitude)


def test_causal_attention_declines_what_it_was_not_built_for(kernel) -> None:
    q, keys = torch.randn(4, 2, 24), torch.randn(4, 1, 24)   # head_dim 24: not a multiple of 16
    assert not kernel.takes_causal(24) and kernel.takes_causal(64) == causal_built(kernel)
    big = paged_decode.CAUSAL_MAX_HEAD_DIM + 16   # past what a thread's stack holds: declined
    assert not kernel.takes_causal(big)
    assert kernel.causal_attention(torch.randn(2, 1, big), torch.randn(2, 1, big), torch.randn(2, 1, big), 0,
                                   0.1) is None
    assert kernel.causal_attention(q, keys, keys.clone(), 0, 0.2) is None
    with pytest.raises(ValueError, match="inconsistent"):   # keys and queries that do not line up
        kernel.causal_attention(torch.randn(4, 2, 16), torch.randn(5, 1, 16), torch.randn(5, 1, 16), 0, 0.25)
    with pytest.raises(ValueError, match="inconsistent"):
        kernel.causal_attention(torch.randn(4, 2, 16).double(), torch.randn(4, 1, 16), torch.randn(4, 1, 16), 0, 0.25)
