"""Logging for every kvserve process, set from the --log-level, --log-format and --log-source
flags: one line a record on stderr, as text or as a JSON object (what a log pipeline parses
without a grok pattern), each carrying the process's source name where it has one (`kvserve up`
names its children: worker-0, worker-0/kvcache, gateway, ...)."""

from __future__ import annotations

import datetime
import json
import logging
import sys

LOG_LEVELS = ("debug", "info", "warning", "error")
DEFAULT_LOG_LEVEL = "info"
LOG_FORMATS = ("text", "json")


class _Json(logging.Formatter):
    """{"time": ISO 8601 UTC, "level", "logger", "message"[, "source"][, "exception"]} a line."""

    def __init__(self, source: str) -> None:
        super().__init__()
        self.source = source

    def format(self, record: logging.LogRecord) -> str:
        entry = {"time": datetime.datetime.fromtimestamp(record.created, datetime.timezone.utc)
                 .isoformat(timespec="milliseconds").replace("+00:00", "Z"),
                 "level": record.levelname, "logger": record.name, "message": record.getMessage()}
        if self.source:
            entry["source"] = self.source
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, ensure_ascii=False)


def _formatter(fmt: str, source: str) -> logging.Formatter:
    if fmt == "json":
        return _Json(source)
    tag = f"[{source}] " if source else ""
    return logging.Formatter(f"%(asctime)s %(levelname)s {tag.replace('%', '%%')}%(name)s: %(message)s")


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


def configure_logging(level: str = DEFAULT_LOG_LEVEL, fmt: str = "text", source: str = "") -> None:
    """Send records at ``level`` and above to stderr, one line each, as text or JSON (`fmt`),
    each naming `source` where given.

    Replaces any handlers already installed, so calling it twice (tests,
    nested CLIs) does not print every line twice.
    """
    name = level.lower()
    if name not in LOG_LEVELS:
        raise ValueError(f"unknown log level {level!r}; choose one of {', '.join(LOG_LEVELS)}")
    if fmt not in LOG_FORMATS:
        raise ValueError(f"unknown log format {fmt!r}; choose one of {', '.join(LOG_FORMATS)}")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_formatter(fmt, source))
    logging.basicConfig(level=name.upper(), handlers=[handler], force=True)
    for logger_name, (prefixes, explanation) in _CLIENTS_DOING.items():
        logger = logging.getLogger(logger_name)
        if not any(isinstance(f, _ClientsDoing) for f in logger.filters):
            logger.addFilter(_ClientsDoing(prefixes, explanation))
