"""Fixtures shared across test packages."""

from __future__ import annotations

from pathlib import Path

import pytest

ARCH_PRESETS = ["tiny", "tiny-qwen2", "tiny-qwen3", "tiny-mistral", "tiny-llama3"]


@pytest.fixture(scope="session")
def tiny_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Every tiny preset, generated once per session (a few seconds each, no weights in the repo)."""
    from kvserve.model_service.tiny_model import make_preset

    root = tmp_path_factory.mktemp("tiny-models")
    return {name: make_preset(root / name, name) for name in ARCH_PRESETS}
