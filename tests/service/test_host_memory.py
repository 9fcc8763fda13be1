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
