"""Logging for every kvserve process, set from the --log-level flag."""

from __future__ import annotations

import logging
import sys

LOG_LEVELS = ("debug", "info", "warning", "error")
DEFAULT_LOG_LEVEL = "info"

_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class _ClientsDoing(logging.Filter):
    """Records a client causes (its bad bytes, its leaving) that libraries log as WARNING or
    ERROR: no fault of the server's, and any client could fill the log with them, before any key
    is looked at. Each becomes one DEBUG line without a traceback, shown only at --log-level
    debug (a propagated record meets no logger's level again, so the filter decides)."""

    def __init__(self, prefixes: tuple[str, ...], explanation: str) -> None:
        super().__init__()
        self.prefixes, self.explanation = prefixes, explanation

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.WARNING or not str(record.msg).startswith(self.prefixes):
            return True
        if not logging.getLogger().isEnabledFor(logging.DEBUG):
            return False
        record.levelno, record.levelname, record.exc_info, record.exc_text = logging.DEBUG, "DEBUG", None, None
        record.msg = f"{record.getMessage()}: {self.explanation}"
        record.args = ()
        return True


# logger: (the messages it logs for what a client did, what they mean)
_CLIENTS_DOING = {
    # grpc.aio: a stream's message could not be sent because its client had just gone
    # (cancelled, or disconnected while the server waited for its flow control)
    "grpc._cython.cygrpc": (("ExecuteBatchError raised in core by servicer method",),
                            "the client went away while a message was being sent"),
    # uvicorn (the HTTP front), before the app sees the request
    "uvicorn.error": (("Invalid HTTP request received", "Unsupported upgrade request",
                       "No supported WebSocket library detected"), "a client's request"),
    # asyncio: writes to an HTTP connection its client had closed
    "asyncio": (("socket.send() raised exception",), "a client closed its connection"),
}


def configure_logging(level: str = DEFAULT_LOG_LEVEL) -> None:
    """Send records at ``level`` and above to stderr, one line each.

    Replaces any handlers already installed, so calling it twice (tests,
    nested CLIs) does not print every line twice.
    """
    name = level.lower()
    if name not in LOG_LEVELS:
        raise ValueError(f"unknown log level {level!r}; choose one of {', '.join(LOG_LEVELS)}")
    logging.basicConfig(level=name.upper(), format=_FORMAT, stream=sys.stderr, force=True)
    for logger_name, (prefixes, explanation) in _CLIENTS_DOING.items():
        logger = logging.getLogger(logger_name)
        if not any(isinstance(f, _ClientsDoing) for f in logger.filters):
            logger.addFilter(_ClientsDoing(prefixes, explanation))
