"""Host memory for CPU forwards: freed memory kept in the process, so forwards do not
page-fault; and the memory a decode step streams (weights, KV pages) on transparent huge pages.

A CPU forward allocates and frees activations of several MB per op (the MLP's
(T, intermediate) tensors are 12 MB at 2048 tokens of the bench model). glibc's
defaults hand such blocks back to the kernel (munmap, heap trim), so the next
step touches fresh pages and the kernel zero-fills them: on the bench workload,
a hundred thousand minor faults a run, and far fewer with the settings below
(docs/benchmarks.md has the counts and the run times). torch's CUDA caching
allocator does this for GPU memory; tcmalloc or jemalloc do it for the host
when preloaded, which a pip install cannot arrange, so we ask glibc directly.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import math
import mmap

import torch

log = logging.getLogger(__name__)

# mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD = -1
_M_TOP_PAD = -2
_M_MMAP_THRESHOLD = -3
_M_ARENA_MAX = -8

_SETTINGS = (
    # Blocks up to 32 MiB (glibc's largest allowed threshold) come from the heap, not mmap.
    # Setting it explicitly also stops glibc from lowering it again.
    (_M_MMAP_THRESHOLD, 32 << 20),
    # Free memory at the heap's top stays mapped up to 1 GiB instead of being trimmed.
    (_M_TRIM_THRESHOLD, 1 << 30),
    # Grow the heap in 64 MiB steps: fewer, larger extensions.
    (_M_TOP_PAD, 64 << 20),
    # One arena for every thread: the engine thread then reuses the heap that loading and the
    # warm-up step (dummy_step.py, on the main thread) grew, instead of faulting in its own.
    # Small blocks come from glibc's per-thread caches and Python's own allocator, lock-free.
    (_M_ARENA_MAX, 1),
)

_done = False


def keep_freed_memory() -> bool:
    """Applies the settings once per process; False where this is not glibc."""
    global _done
    if _done:
        return True
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        mallopt, gnu_version = libc.mallopt, libc.gnu_get_libc_version
    except (OSError, AttributeError, TypeError):
        log.debug("not glibc (%s): malloc left as it is", name)
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    gnu_version.restype = ctypes.c_char_p
    ok = all(mallopt(param, value) == 1 for param, value in _SETTINGS)
    if not ok:
        log.warning("glibc %s refused a malloc setting; CPU steps may page-fault more",
                    gnu_version().decode())
    _done = ok
    return ok


HUGE_PAGE = 2 << 20


def huge_page_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zeroed CPU tensor on a private anonymous mapping advised for transparent huge pages.

    Why: a decode step streams every weight once and reads K/V pages all over the pool, and with
    4 KiB pages each few KB read costs a TLB miss, a two-level page walk in a virtual machine: on
    a KVM guest the weights on 2 MiB pages made a batch-1 step 5-13 % faster (docs/benchmarks.md,
    "One request at a time and 32 at once"). The pages are faulted in here, not during a step.
    Where the kernel has no MADV_HUGEPAGE (not Linux) or the tensor is under one huge page: torch.zeros.
    """
    numel = math.prod(shape)
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    if nbytes < HUGE_PAGE or not hasattr(mmap, "MADV_HUGEPAGE"):
        return torch.zeros(shape, dtype=dtype)
    # Private: THP for shared anonymous memory is a separate, usually disabled, setting.
    mapping = mmap.mmap(-1, -(-nbytes // HUGE_PAGE) * HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        mapping.madvise(mmap.MADV_HUGEPAGE)
    except OSError as exc:   # THP compiled out: still a valid mapping on small pages
        log.debug("madvise(MADV_HUGEPAGE) refused: %s", exc)
    tensor = torch.frombuffer(mapping, dtype=dtype, count=numel).view(shape)   # keeps the mapping alive
    return tensor.zero_()


def on_huge_pages(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of a CPU tensor on huge pages (huge_page_zeros)."""
    out = huge_page_zeros(tuple(tensor.shape), tensor.dtype)
    return out.copy_(tensor)
