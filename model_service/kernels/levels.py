"""What each native kernel is built for, and how: read by setup.py when kvserve is installed
and by library.py when a kernel is loaded. Plain Python, no imports of kvserve or torch.

A kernel is compiled once per instruction-set level it lists, best first; at run time the
best level whose CPU flags this machine reports is loaded. The x86-64 levels are GCC's
micro-architecture levels (-march=x86-64-v3: AVX2 and FMA; -v4: AVX-512 F/BW/CD/DQ/VL), not
-march=native: a wheel or an image built on one machine must run on another.

Compile flags and why:
- -O3: the inner loops are vectorised by the compiler (paged_decode.c) or written with
  intrinsics (cpu_gemm.c, small_linear.c).
- -ffast-math: lets GCC call glibc's vectorised expf (libmvec) inside `omp simd` loops and
  reorder the softmax sums. Both kernels are written for it: no inf or NaN is ever formed
  on purpose (-FLT_MAX stands for -inf, SiLU clamps its argument), and results differ from
  torch's only in rounding. Compile only: at link time it would add crtfastmath.o, which
  sets flush-to-zero for every thread of the process, torch's included.
- -fopenmp: the kernels' parallel loops, run on torch's OpenMP pool (library.py).
- -mtune=generic, and an explicit -march on x86-64 even for the generic level: flags from the
  environment ($CFLAGS, which setuptools passes first) cannot tune a build to the build machine.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Level:
    name: str
    march: str                 # -march for GCC on x86-64; "" elsewhere is the compiler's default target
    flags: frozenset[str]      # /proc/cpuinfo flags a CPU needs to run what -march allows
    x86_64_only: bool = True


_X86_64_V3 = frozenset({"avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "abm", "movbe", "xsave",
                        "cx16", "lahf_lm", "popcnt", "sse4_1", "sse4_2", "ssse3"})
LEVELS = {
    "avx512": Level("avx512", "x86-64-v4", _X86_64_V3 | {"avx512f", "avx512bw", "avx512cd", "avx512dq",
                                                          "avx512vl"}),
    "avx2": Level("avx2", "x86-64-v3", _X86_64_V3),
    # Any CPU: on x86-64 the baseline ISA, named so that a -march in $CFLAGS cannot leak in.
    "generic": Level("generic", "x86-64", frozenset(), x86_64_only=False),
}

# kernel (its C file's stem) -> the levels it is built for, best first
KERNELS = {
    "paged_decode": ("avx512", "avx2", "generic"),
    "cpu_gemm": ("avx512",),   # its tiles are AVX-512 intrinsics
    "small_linear": ("avx512", "avx2", "generic"),   # AVX2 + FMA intrinsics; plain C elsewhere
    "rms_norm": ("avx512", "avx2", "generic"),       # vectorised by the compiler
    "rope": ("avx512", "avx2", "generic"),
    "decode_layer": ("avx512", "avx2", "generic"),   # small_linear's row dot, paged_decode's attention
    "row_argmax": ("avx512", "avx2", "generic"),     # vectorised by the compiler
}

COMPILE_FLAGS = ("-O3", "-ffast-math", "-fopenmp", "-std=c11", "-mtune=generic")


def builds_for(machine: str) -> list[tuple[str, str, str]]:
    """(kernel, level, -march or "") of every library setup.py builds on `machine`
    (platform.machine()); -march only on x86-64."""
    x86_64 = machine in ("x86_64", "AMD64")
    return [(kernel, name, LEVELS[name].march if x86_64 else "")
            for kernel, names in KERNELS.items() for name in names
            if x86_64 or not LEVELS[name].x86_64_only]


def source_digest(folder: Path, kernel: str) -> str | None:
    """SHA-256 of `kernel`'s C file and every header beside it (the kernels share code through
    them): what a library is stamped with when built, and checked against when loaded. None
    where the C file is not at hand (an installed wheel)."""
    source = Path(folder) / f"{kernel}.c"
    if not source.is_file():
        return None
    digest = hashlib.sha256(source.read_bytes())
    for header in sorted(Path(folder).glob("*.h")):
        digest.update(header.read_bytes())
    return digest.hexdigest()
