"""Builds kvserve's native CPU kernels (C files beside their Python wrappers) once per machine.

A kernel is built with the machine's C compiler and -march=native, and kept in
the user cache dir under a name that hashes the source, the flags, the
compiler, the CPU and torch's OpenMP runtime; later starts load it in
milliseconds. Nothing here is required: without a compiler, or with a torch
that brings no OpenMP runtime, build_and_load() says why and the caller serves
with torch's own ops as before.

Two rules every build keeps:
- A kernel's `omp parallel` must run on torch's own OpenMP pool: a second
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
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import torch

from kvserve.model_service.user_cache import user_cache_dir

log = logging.getLogger(__name__)

COMPILE_FLAGS = ("-O3", "-march=native", "-ffast-math", "-fopenmp", "-fPIC", "-std=c11")


class KernelUnavailable(RuntimeError):
    """A kernel cannot be built or loaded here; the message says why."""


K = TypeVar("K")


def once_per_process(build: Callable[[], K]) -> Callable[[], K]:
    """A loader that runs build() once: later calls return the same kernel, or raise
    KernelUnavailable with the same reason (one build attempt per process)."""
    @functools.cache
    def outcome() -> K | KernelUnavailable:
        try:
            return build()
        except KernelUnavailable as exc:
            return exc

    def load() -> K:
        kernel = outcome()
        if isinstance(kernel, KernelUnavailable):
            raise KernelUnavailable(str(kernel))
        return kernel

    load.__doc__ = "The kernel, built if this machine has no copy yet; raises KernelUnavailable."
    return load


def build_and_load(source: Path) -> tuple[ctypes.CDLL, Path]:
    """`source` compiled into a shared library (built now unless cached) and loaded."""
    openmp = _torch_openmp_library()
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise KernelUnavailable("no C compiler (cc, gcc or $CC) on this machine")
    path = user_cache_dir("kernels") / f"{source.stem}-{_build_key(source, compiler, openmp)}.so"
    if not path.is_file():
        try:
            _build(source, compiler, openmp, path)
        except OSError as exc:   # a read-only or full cache dir, say
            raise KernelUnavailable(f"cannot build into {path.parent}: {exc}") from exc
    try:
        return ctypes.CDLL(str(path)), path
    except OSError as exc:
        raise KernelUnavailable(f"cannot load {path}: {exc}") from exc


def cpu_flags() -> str:
    """The CPU's feature flags (/proc/cpuinfo); -march=native code runs only where they match."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor()


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


def _build_key(source: Path, compiler: str, openmp: Path) -> str:
    """Anything that changes the machine code, or which library it must run against."""
    try:
        version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise KernelUnavailable(f"{compiler} --version failed: {exc}") from exc
    parts = [source.read_text(), " ".join(COMPILE_FLAGS), version, str(openmp), platform.machine(), cpu_flags()]
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:16]


def _build(source: Path, compiler: str, openmp: Path, path: Path) -> None:
    """Compile into a private temp dir, then rename into place: several processes may build
    at once, and a reader sees no library or a whole one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
        obj, lib = Path(tmp) / f"{source.stem}.o", Path(tmp) / path.name
        commands = [
            [compiler, *COMPILE_FLAGS, "-c", str(source), "-o", str(obj)],
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
    log.info("built %s: %s", source.name, path)
