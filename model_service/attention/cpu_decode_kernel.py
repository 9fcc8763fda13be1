"""The native paged decode kernel (paged_decode.c): built on first use, called through ctypes.

The build runs the machine's C compiler once, with -march=native, and keeps the
library in the user cache dir under a name that hashes the source, the flags,
the compiler, the CPU and torch's OpenMP runtime; later starts load it in
milliseconds. Nothing here is required: without a compiler, or with a torch that
brings no OpenMP runtime, load() says why and the torch backend serves as before.

Two rules the build keeps:
- The kernel's `omp parallel` must run on torch's own OpenMP pool: a second
  OpenMP runtime in the process would keep its own spinning threads and fight
  torch's for the same cores. So the library links the exact libgomp file torch
  loaded (found in /proc/self/maps), and the loader reuses the loaded copy.
- -ffast-math (for vectorised expf) at compile time only: linking a shared
  library with it makes GCC add crtfastmath.o, which would switch on
  flush-to-zero for every thread of the process, torch's included.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from model_service.user_cache import user_cache_dir

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("paged_decode.c")
COMPILE_FLAGS = ("-O3", "-march=native", "-ffast-math", "-fopenmp", "-fPIC", "-std=c11")
MAX_HEAD_FLOATS = 16384   # num_heads * head_dim: three such arrays live on a thread's stack
MAX_PAGE_SIZE = 256       # the page's scores live on the stack too


class KernelUnavailable(RuntimeError):
    """The kernel cannot be built or loaded here; the message says why."""


class PagedDecodeKernel:
    """out (n, H, D) = attention of q (n, H, D), one query per sequence, over its pages."""

    def __init__(self, library: ctypes.CDLL, path: Path) -> None:
        self.path = path
        fn = library.kvserve_paged_decode_f32
        ptr, i64 = ctypes.c_void_p, ctypes.c_int64
        fn.argtypes = [ptr, ptr, ptr, ptr, i64, ptr, ptr, i64, i64, i64, i64, i64,
                       ctypes.c_float, ctypes.c_int32]
        fn.restype = None
        self._fn = fn

    def __call__(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 tables: torch.Tensor, seq_lens: torch.Tensor, scale: float, max_len: int) -> torch.Tensor:
        """tables (n, >= pages) int32 with rows contiguous, seq_lens (n,) int32, each >= 1;
        max_len: the longest of seq_lens (the caller has it as a Python int)."""
        n, h, d = q.shape
        q = q.contiguous()
        out = torch.empty_like(q)
        # The C side trusts every pointer and stride: check what it cannot.
        if not (tables.shape[0] == seq_lens.shape[0] == n and k_cache.shape == v_cache.shape
                and k_cache.is_contiguous() and v_cache.is_contiguous() and tables.stride(1) == 1
                and seq_lens.is_contiguous() and tables.dtype == seq_lens.dtype == torch.int32
                and h % k_cache.shape[2] == 0 and k_cache.shape[3] == d
                and q.dtype == k_cache.dtype == v_cache.dtype == torch.float32 and q.device.type == "cpu"
                and h * d <= MAX_HEAD_FLOATS and k_cache.shape[1] <= MAX_PAGE_SIZE
                and max_len <= tables.shape[1] * k_cache.shape[1]):
            raise ValueError("paged decode kernel: inconsistent shapes, strides or dtypes")
        # ctypes drops the GIL for the call, as a torch op does.
        self._fn(q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), tables.data_ptr(), tables.stride(0),
                 seq_lens.data_ptr(), out.data_ptr(), n, h, k_cache.shape[2], d, k_cache.shape[1],
                 scale, torch.get_num_threads())
        return out


def load() -> PagedDecodeKernel:
    """The kernel, built if this machine has no copy yet. Raises KernelUnavailable, with the
    same reason on every call: one build attempt per process."""
    kernel = _load_once()
    if isinstance(kernel, KernelUnavailable):
        raise KernelUnavailable(str(kernel))
    return kernel


@functools.cache
def _load_once() -> PagedDecodeKernel | KernelUnavailable:
    try:
        return _build_and_load()
    except KernelUnavailable as exc:
        return exc


def _build_and_load() -> PagedDecodeKernel:
    openmp = _torch_openmp_library()
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise KernelUnavailable("no C compiler (cc, gcc or $CC) on this machine")
    path = user_cache_dir("kernels") / f"paged_decode-{_build_key(compiler, openmp)}.so"
    if not path.is_file():
        try:
            _build(compiler, openmp, path)
        except OSError as exc:   # a read-only or full cache dir, say
            raise KernelUnavailable(f"cannot build into {path.parent}: {exc}") from exc
    try:
        library = ctypes.CDLL(str(path))
    except OSError as exc:
        raise KernelUnavailable(f"cannot load {path}: {exc}") from exc
    return PagedDecodeKernel(library, path)


def _torch_openmp_library() -> Path:
    """The libgomp file torch runs its intra-op threads on, as loaded in this process."""
    if "OpenMP" not in torch.__config__.parallel_info():
        raise KernelUnavailable("this torch build runs no OpenMP intra-op pool")
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError as exc:
        raise KernelUnavailable(f"cannot read /proc/self/maps ({exc}): not Linux?") from exc
    for line in maps.splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and Path(fields[5]).name.startswith("libgomp"):
            return Path(fields[5])
    raise KernelUnavailable("torch's OpenMP runtime is not GNU libgomp")


def _build_key(compiler: str, openmp: Path) -> str:
    """Anything that changes the machine code, or which library it must run against."""
    try:
        version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise KernelUnavailable(f"{compiler} --version failed: {exc}") from exc
    parts = [SOURCE.read_text(), " ".join(COMPILE_FLAGS), version, str(openmp), platform.machine(), _cpu_flags()]
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:16]


def _cpu_flags() -> str:
    """-march=native code runs only on a CPU with the same features."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor()


def _build(compiler: str, openmp: Path, path: Path) -> None:
    """Compile into a private temp dir, then rename into place: several processes may build
    at once, and a reader sees no library or a whole one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
        obj, lib = Path(tmp) / "paged_decode.o", Path(tmp) / path.name
        commands = [
            [compiler, *COMPILE_FLAGS, "-c", str(SOURCE), "-o", str(obj)],
            [compiler, "-shared", str(obj), "-o", str(lib), str(openmp),
             f"-Wl,-rpath,{openmp.parent}", "-lm"],
        ]
        for command in commands:
            try:
                done = subprocess.run(command, capture_output=True, text=True, timeout=300)
            except (OSError, subprocess.TimeoutExpired) as exc:
                raise KernelUnavailable(f"{' '.join(command)}: {exc}") from exc
            if done.returncode:
                raise KernelUnavailable(f"{' '.join(command)} failed:\n{done.stderr.strip()[-2000:]}")
        os.replace(lib, path)
    log.info("built the paged decode kernel: %s", path)
