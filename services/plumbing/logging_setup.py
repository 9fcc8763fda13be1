"""Logging for every kvserve process, set from the --log-level flag."""

from __future__ import annotations

import logging
import sys

LOG_LEVELS = ("debug", "info", "warning", "error")
DEFAULT_LOG_LEVEL = "info"

_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class _ClientGoneWhileSending(logging.Filter):
    """grpc.aio logs an ERROR with a traceback when a stream's message could not be sent because
    its client had just gone (cancelled, or disconnected while the server waited for its flow
    control): no fault of the server's, and any client could fill the log with them. Shown as one
    DEBUG line, without the traceback."""

    PREFIX = "ExecuteBatchError raised in core by servicer method"

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.ERROR or not str(record.msg).startswith(self.PREFIX):
            return True
        if not logging.getLogger().isEnabledFor(logging.DEBUG):
            return False
        record.levelno, record.levelname, record.exc_info, record.exc_text = logging.DEBUG, "DEBUG", None, None
        record.msg = f"{record.getMessage()}: the client went away while a message was being sent"
        record.args = ()
        return True


_GRPC_CORE_LOGGER = "grpc._cython.cygrpc"


def configure_logging(level: str = DEFAULT_LOG_LEVEL) -> None:
    """Send records at ``level`` and above to stderr, one line each.

    Replaces any handlers already installed, so calling it twice (tests,
    nested CLIs) does not print every line twice.
    """
    name = level.lower()
    if name not in LOG_LEVELS:
        raise ValueError(f"unknown log level {level!r}; choose one of {', '.join(LOG_LEVELS)}")
    logging.basicConfig(level=name.upper(), format=_FORMAT, stream=sys.stderr, force=True)
    grpc_core = logging.getLogger(_GRPC_CORE_LOGGER)
    if not any(isinstance(f, _ClientGoneWhileSending) for f in grpc_core.filters):
        grpc_core.addFilter(_ClientGoneWhileSending())
