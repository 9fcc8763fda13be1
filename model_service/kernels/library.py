"""Loads kvserve's native CPU kernels, built when the package was installed (setup.py).

Each kernel (a C file beside its Python wrapper) is compiled once per instruction-set level
(levels.py) into its own shared library, `_<kernel>_<level>.<ext>` in this folder; at run
time the best level this CPU supports (its /proc/cpuinfo flags) is loaded. Nothing is
compiled while serving, so a serving image needs no C compiler.

Two rules every library keeps:
- A kernel's `omp parallel` runs on torch's own OpenMP pool: a second OpenMP runtime in the
  process would keep its own spinning threads and fight torch's for the same cores. So the
  libraries are linked without one: their GOMP_* symbols resolve, when loaded, against the
  libgomp torch loaded (promoted to the global namespace first). A torch without OpenMP
  leaves the kernels unavailable.
- -ffast-math at compile time only (levels.py says why).

Without a usable library (no build for this CPU, no compiler at install time, a library
older than its C file) load() raises KernelUnavailable saying why, and the model service
falls back to oneDNN and torch's own ops.
"""

from __future__ import annotations

import ctypes
import functools
import importlib.machinery
import platform
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import torch

from kvserve.model_service.kernels.levels import KERNELS, LEVELS, builds_for, source_digest

HERE = Path(__file__).resolve().parent


class KernelUnavailable(RuntimeError):
    """A kernel cannot be loaded here; the message says why."""


class NotForThisCpu(KernelUnavailable):
    """The kernel is built for no level this CPU runs: expected, not a fault to warn about."""


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags (/proc/cpuinfo); empty where they cannot be read."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def library_path(kernel: str, level: str) -> Path | None:
    """The built library of `kernel` for `level`, or None if setup.py did not build it."""
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        path = HERE / f"_{kernel}_{level}{suffix}"
        if path.is_file():
            return path
    return None


def load_library(kernel: str, needs: str) -> tuple[ctypes.CDLL, str]:
    """The library of `kernel` for the best level this CPU runs, and that level's name.
    `needs` names, for a person, what the kernel needs of the CPU (said when no level fits)."""
    if platform.system() != "Linux":
        raise KernelUnavailable(f"kvserve's native kernels are built for Linux, not {platform.system()}")
    flags, x86_64 = cpu_flags(), platform.machine() in ("x86_64", "AMD64")
    usable = [LEVELS[name] for name in KERNELS[kernel]
              if LEVELS[name].flags <= flags and (x86_64 or not LEVELS[name].x86_64_only)]
    if not usable:
        raise NotForThisCpu(f"the {kernel} kernel needs {needs}, which this CPU does not have")
    _share_torchs_openmp()
    problems = []
    for level in usable:   # the best first; a library that is missing or will not load gives way
        path = library_path(kernel, level.name)
        if path is None:
            problems.append(f"{level.name}: not built when kvserve was installed")
            continue
        try:
            library = ctypes.CDLL(str(path))
        except OSError as exc:
            problems.append(f"{level.name}: cannot load {path.name}: {exc}")
            continue
        stale = _stale(kernel, library, path)
        if stale:
            problems.append(f"{level.name}: {stale}")
            continue
        return library, level.name
    raise KernelUnavailable(f"no build of the {kernel} kernel for this CPU loads ({'; '.join(problems)}): install "
                            "kvserve again where a C compiler is present (make install, or pip install .)")


def missing_builds() -> list[str]:
    """The libraries setup.py builds on this machine that are not here (a build that failed
    quietly: the extensions are optional)."""
    return [f"{kernel} ({level})" for kernel, level, _ in builds_for(platform.machine())
            if library_path(kernel, level) is None]


def _share_torchs_openmp() -> None:
    """Puts the libgomp torch runs its intra-op threads on in the global namespace, where
    the kernels' GOMP_* symbols resolve (it is usually there already)."""
    if "OpenMP" not in torch.__config__.parallel_info():
        raise KernelUnavailable("this torch build runs no OpenMP intra-op pool")
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError as exc:
        raise KernelUnavailable(f"cannot read /proc/self/maps ({exc})") from exc
    for line in maps.splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and Path(fields[5]).name.startswith("libgomp"):
            ctypes.CDLL(fields[5], mode=ctypes.RTLD_GLOBAL)   # already loaded: only promoted
            return
    raise KernelUnavailable("torch's OpenMP runtime is not GNU libgomp")


def source_sha256(kernel: str) -> str | None:
    return source_digest(HERE, kernel)


def _stale(kernel: str, library: ctypes.CDLL, path: Path) -> str | None:
    """Where the C file is at hand (a checkout), the library must be built from it as it is:
    why not, or None."""
    want = source_sha256(kernel)
    if want is None:
        return None
    built_from = library.kvserve_source_sha256
    built_from.restype = ctypes.c_char_p
    if built_from().decode() != want:
        return f"{path.name} was built from an older {kernel}.c"
    return None


K = TypeVar("K")


def once_per_process(load: Callable[[], K]) -> Callable[[], K]:
    """A loader that runs load() once: later calls return the same kernel, or raise
    KernelUnavailable with the same reason."""
    @functools.cache
    def outcome() -> K | KernelUnavailable:
        try:
            return load()
        except KernelUnavailable as exc:
            return exc

    def kernel() -> K:
        found = outcome()
        if isinstance(found, KernelUnavailable):
            raise type(found)(str(found))
        return found

    kernel.__doc__ = "The kernel, loaded once per process; raises KernelUnavailable saying why not."
    return kernel
