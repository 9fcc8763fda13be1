"""kvserve's version, as its installed package says it (`kvserve --version`, the HTTP front's
/version)."""

from __future__ import annotations

from importlib import metadata


def kvserve_version() -> str:
    try:
        return metadata.version("kvserve")
    except metadata.PackageNotFoundError:
        return "(not installed)"
