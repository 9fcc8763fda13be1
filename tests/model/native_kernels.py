"""The native CPU kernels for tests: loaded, or skipped with the reason they do not build here."""

from __future__ import annotations

import contextlib
import platform
from collections.abc import Callable, Iterator
from typing import TypeVar

import pytest
import torch

from kvserve.model_service.kernels import library
from kvserve.model_service.kernels.levels import KERNELS, LEVELS
from kvserve.model_service.kernels.library import KernelUnavailable

K = TypeVar("K")


def why_not(load: Callable[[], object]) -> str | None:
    """None where load() gives its kernel, else why it cannot."""
    try:
        load()
        return None
    except KernelUnavailable as exc:
        return str(exc)


def load_or_skip(load: Callable[[], K], what: str) -> K:
    try:
        return load()
    except KernelUnavailable as exc:
        pytest.skip(f"{what} does not build here: {exc}")


def runnable_levels(kernel: str) -> list[str]:
    """The levels `kernel` is built for that this CPU runs, best first. Serving loads only the
    best; a kernel's arithmetic is tested at each, so that a CI machine with AVX-512 still
    checks the AVX2 build most AMD servers load."""
    x86_64 = platform.machine() in ("x86_64", "AMD64")
    return [name for name in KERNELS[kernel]
            if LEVELS[name].flags <= library.cpu_flags() and (x86_64 or not LEVELS[name].x86_64_only)]


def load_at_level(load: Callable[[], K], level: str, what: str) -> K:
    """load() (a kernel module's uncached _load) as on a CPU whose best level is `level`."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(library, "cpu_flags", lambda: LEVELS[level].flags)
        found = load_or_skip(load, f"{what} ({level})")
    assert getattr(found, "level", level) == level
    return found


@contextlib.contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """torch's (and so every kernel's) thread count set to n for the block, restored after."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)
