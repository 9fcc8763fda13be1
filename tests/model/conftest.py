"""Tiny generated checkpoints, built once per test session into a temp dir."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from kvserve.model_service.attention.base import AttentionBackend
from kvserve.model_service.attention.select import select_backend
from kvserve.model_service.attention.select import torch_attention
from kvserve.model_service.model.config import ModelConfig
from kvserve.model_service.model.llama import CausalLM
from kvserve.model_service.model.loader import load_model

from tests.conftest import ARCH_PRESETS  # tiny_dirs, the session's checkpoints, comes from there too


@dataclass
class Loaded:
    path: Path
    model: CausalLM
    config: ModelConfig
    hf: torch.nn.Module


@pytest.fixture(scope="session")
def load_pair(tiny_dirs: dict[str, Path]) -> Callable[[str], Loaded]:
    """name -> our model and transformers' on that tiny checkpoint (float32, CPU), loaded once."""
    from transformers import AutoModelForCausalLM

    cache: dict[str, Loaded] = {}

    def load(name: str) -> Loaded:
        if name not in cache:
            model, config = load_model(tiny_dirs[name], torch.float32, "cpu")
            hf = AutoModelForCausalLM.from_pretrained(tiny_dirs[name], dtype=torch.float32).eval()
            cache[name] = Loaded(tiny_dirs[name], model, config, hf)
        return cache[name]

    return load


@pytest.fixture(params=ARCH_PRESETS)
def loaded(request: pytest.FixtureRequest, load_pair: Callable[[str], Loaded]) -> Loaded:
    return load_pair(request.param)


@pytest.fixture(params=["torch", "cpu"])
def backend(request: pytest.FixtureRequest) -> AttentionBackend:
    """Both CPU backends: torch, the reference, and cpu as `auto` picks it (its decode through
    the native kernel; skipped where the kernel does not build)."""
    if request.param == "torch":
        return torch_attention()
    try:
        return select_backend("cpu", "cpu", dtype=torch.float32)
    except RuntimeError as exc:
        pytest.skip(f"the cpu backend does not run here: {exc}")


@pytest.fixture(scope="package", autouse=True)
def one_thread():
    """Tiny matmuls gain nothing from threads, and lose much when a core is busy elsewhere."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
