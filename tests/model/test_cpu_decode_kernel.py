"""The native paged decode kernel (attention/paged_decode.c) and how it is built and loaded."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve.model_service.attention import cpu_decode_kernel
from kvserve.model_service.attention.cpu_decode_kernel import KernelUnavailable
from tests.model.native_kernels import load_or_skip


@pytest.fixture(scope="module")
def kernel() -> cpu_decode_kernel.PagedDecodeKernel:
    return load_or_skip(cpu_decode_kernel.load, "the paged decode kernel")


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
       threads=st.sampled_from([1, 2]))
def test_kernel_matches_reference(kernel, seed, num_kv_heads, group, head_dim, page_size, lens,
                                  extra_columns, threads) -> None:
    q, k_cache, v_cache, tables, seq_lens = random_case(seed, num_kv_heads, group, head_dim, page_size,
                                                        lens, extra_columns)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = kernel(q, k_cache, v_cache, tables, seq_lens, scale=head_dim ** -0.5, max_len=max(lens))
    finally:
        torch.set_num_threads(before)
    expected = reference(q, k_cache, v_cache, tables, seq_lens, head_dim ** -0.5)
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)


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


def test_loading_the_kernel_keeps_denormals_and_one_openmp_runtime(kernel) -> None:
    # A shared library linked with -ffast-math would switch on flush-to-zero process-wide.
    tiny = torch.tensor([1e-39], dtype=torch.float32)         # below float32's smallest normal
    assert (tiny * 1.0).item() != 0.0
    gomps = {line.split()[-1] for line in Path("/proc/self/maps").read_text().splitlines()
             if Path(line.split()[-1]).name.startswith("libgomp")}
    assert len(gomps) == 1, f"more than one OpenMP runtime loaded: {gomps}"


def test_build_goes_to_the_cache_once_and_is_reused(kernel, tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    built = cpu_decode_kernel._build_and_load()
    assert built.path.parent == tmp_path / "kvserve" / "kernels" and built.path.is_file()
    mtime = built.path.stat().st_mtime_ns
    again = cpu_decode_kernel._build_and_load()
    assert again.path == built.path and built.path.stat().st_mtime_ns == mtime
    assert os.listdir(built.path.parent) == [built.path.name]   # no temp files left behind


def test_a_missing_or_failing_compiler_is_reported(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    with pytest.raises(KernelUnavailable, match="no-such-cc"):
        cpu_decode_kernel._build_and_load()
    broken = tmp_path / "broken-cc"
    broken.write_text("#!/bin/sh\nif [ \"$1\" = --version ]; then echo broken 1.0; exit 0; fi\n"
                      "echo 'cc: internal error' >&2; exit 1\n")
    broken.chmod(0o755)
    monkeypatch.setenv("CC", str(broken))
    with pytest.raises(KernelUnavailable, match="failed:\ncc: internal error"):
        cpu_decode_kernel._build_and_load()
    assert not list((tmp_path / "kvserve" / "kernels").glob("*.so"))


def test_a_cache_dir_that_cannot_be_written_is_reported(tmp_path, monkeypatch) -> None:
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("")
    monkeypatch.setenv("XDG_CACHE_HOME", str(not_a_dir))
    with pytest.raises(KernelUnavailable, match="cannot build into"):
        cpu_decode_kernel._build_and_load()


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
