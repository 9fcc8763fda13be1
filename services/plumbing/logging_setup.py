"""Logging for every kvserve process, set from the --log-level flag."""

from __future__ import annotations

import logging
import sys

LOG_LEVELS = ("debug", "info", "warning", "error")
DEFAULT_LOG_LEVEL = "info"

_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def configure_logging(level: str = DEFAULT_LOG_LEVEL) -> None:
    """Send records at ``level`` and above to stderr, one line each.

    Replaces any handlers already installed, so calling it twice (tests,
    nested CLIs) does not print every line twice.
    """
    name = level.lower()
    if name not in LOG_LEVELS:
        raise ValueError(f"unknown log level {level!r}; choose one of {', '.join(LOG_LEVELS)}")
    logging.basicConfig(level=name.upper(), format=_FORMAT, stream=sys.stderr, force=True)
