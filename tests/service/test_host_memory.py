"""host_memory: glibc keeps freed activation-sized blocks, so warm steps stop page-faulting."""

from __future__ import annotations

import json
import platform
import subprocess
import sys

import pytest

# One process per mode: the settings are process-wide. Three 20 MiB activations alive at once,
# then freed, as a forward's ops allocate them. Reports where the first block came from (glibc
# counts mmap-ed blocks in hblkhd) and the minor faults of warm rounds.
SCRIPT = """
import ctypes, json, resource, sys, torch
from kvserve.model_service.host_memory import keep_freed_memory
class MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in
                "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()]
libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = MallInfo2
tuned = sys.argv[1] == "tuned"
if tuned:
    assert keep_freed_memory() and keep_freed_memory()   # idempotent
before = libc.mallinfo2().hblkhd
a = torch.ones(5 << 20)
mmapped = libc.mallinfo2().hblkhd - before
del a
def rounds(n):
    for _ in range(n):
        a = torch.ones(5 << 20); b = torch.ones(5 << 20); c = torch.ones(5 << 20); del a, b, c
rounds(8)   # the heap grows to its steady size (small allocations in between fragment it)
start = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
rounds(10)
print(json.dumps({"mmapped": mmapped, "faults": resource.getrusage(resource.RUSAGE_SELF).ru_minflt - start}))
"""


def run(mode: str) -> dict:
    out = subprocess.run([sys.executable, "-c", SCRIPT, mode], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.splitlines()[-1])


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="the settings are glibc's")
def test_activation_sized_blocks_come_from_a_heap_that_is_kept() -> None:
    tuned, default = run("tuned"), run("default")
    print(f"tuned {tuned}, glibc defaults {default}")
    assert default["mmapped"] >= 20 << 20           # glibc's default: a fresh mmap, faulted in on use
    assert tuned["mmapped"] == 0                    # tuned: from the heap
    assert tuned["faults"] < 1000                   # and warm rounds reuse its pages (15k faults a cold round)


def test_huge_page_tensors_are_zeroed_writable_and_outlive_their_mapping() -> None:
    import gc

    import torch

    from kvserve.model_service.host_memory import HUGE_PAGE, huge_page_zeros, on_huge_pages

    big = huge_page_zeros((3, HUGE_PAGE // 4 + 5), torch.float32)   # just over 1.5 huge pages a row
    gc.collect()   # the mapping is referenced by the tensor alone
    assert big.shape == (3, HUGE_PAGE // 4 + 5) and big.dtype == torch.float32 and big.is_contiguous()
    assert not big.any()
    big[2, -1] = 7.0
    assert big.sum() == 7.0
    small = huge_page_zeros((4, 4), torch.bfloat16)   # under one huge page: plain torch.zeros
    assert small.dtype == torch.bfloat16 and not small.any()
    source = torch.randn(600, 1024).bfloat16()
    copy = on_huge_pages(source)
    assert torch.equal(copy, source) and copy.data_ptr() != source.data_ptr()


@pytest.mark.skipif(platform.system() != "Linux", reason="transparent huge pages are Linux's")
def test_streamed_weights_and_kv_pages_live_on_huge_page_mappings(tiny_dirs) -> None:
    """What a decode step streams sits on mappings advised for huge pages (/proc/self/smaps marks
    them 'hg'): a linear's weight once the loader's use_small(place=on_huge_pages) moved it (the
    layer's own weight moved with it: nothing kept twice), and the KV pool."""
    import torch

    from kvserve.model_service.host_memory import on_huge_pages
    from kvserve.model_service.kernels import small_linear
    from kvserve.model_service.kv_cache import KVCache
    from kvserve.model_service.model.config import ModelConfig
    from kvserve.model_service.model.linear import Linear
    from tests.model.native_kernels import load_or_skip

    kernel = load_or_skip(small_linear.load, "the small-batch linear")
    linear = Linear(1024, 1024)   # 4 MiB
    linear.use_small(kernel, place=on_huge_pages)
    cache = KVCache(ModelConfig.from_pretrained(tiny_dirs["tiny"]), 4096, 16)
    advised = _huge_page_advised_ranges()
    for tensor in (linear.plain.weight, cache.pool):
        assert any(lo <= tensor.data_ptr() < hi for lo, hi in advised), "not on a huge-page mapping"
    assert linear.weight.data_ptr() == linear.plain.weight.data_ptr()
    x = torch.randn(2, 1024)
    torch.testing.assert_close(linear(x), torch.nn.functional.linear(x, linear.weight, linear.bias))


def _huge_page_advised_ranges() -> list[tuple[int, int]]:
    ranges, current = [], None
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0] if line.split() else ""
            if "-" in head and ":" not in head:
                lo, hi = (int(v, 16) for v in head.split("-"))
                current = (lo, hi)
            elif line.startswith("VmFlags:") and " hg" in line and current:
                ranges.append(current)
    return ranges
