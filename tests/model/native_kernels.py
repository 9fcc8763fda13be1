"""The native CPU kernels for tests: loaded, or skipped with the reason they do not build here."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import TypeVar

import pytest
import torch

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


@contextlib.contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """torch's (and so every kernel's) thread count set to n for the block, restored after."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)
