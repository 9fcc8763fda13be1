"""Where kvserve keeps what it builds once per user: generated models, compiled kernels."""

from __future__ import annotations

import os
from pathlib import Path


def user_cache_dir(name: str) -> Path:
    """$XDG_CACHE_HOME/kvserve/NAME, or ~/.cache/kvserve/NAME."""
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "kvserve" / name
