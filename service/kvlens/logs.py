"""One logging configuration for kvlens and for uvicorn: the command line installs it, and hands
the same dictionary to uvicorn as its ``log_config``, so a server's lines (kvlens's and uvicorn's)
share one format: text with an ISO 8601 UTC timestamp, or one JSON object per line (``ts``,
``level``, ``logger``, ``message``; ``exception`` when there is one) for a log pipeline."""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import Any

LEVELS = ("debug", "info", "warning", "error", "critical")
FORMATS = ("text", "json")
TEXT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class _UtcFormatter(logging.Formatter):
    def formatTime(self, record: logging.LogRecord, datefmt: str | None = None) -> str:
        stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
        return f"{stamp}.{int(record.msecs):03d}Z"


class TextFormatter(_UtcFormatter):
    def __init__(self) -> None:
        super().__init__(TEXT)


class JsonFormatter(_UtcFormatter):
    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, Any] = {
            "ts": self.formatTime(record),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        return json.dumps(line, ensure_ascii=False)


class StderrHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """Writes to the ``sys.stderr`` of the moment, not the one at configuration: a command run
    twice in one process (the tests) must not log into a stream since closed."""

    def __init__(self) -> None:
        super().__init__(sys.stderr)

    def emit(self, record: logging.LogRecord) -> None:
        self.stream = sys.stderr
        super().emit(record)


def config(level: str, fmt: str) -> dict[str, Any]:
    """The ``logging.config.dictConfig`` of ``level`` (any case) and ``fmt`` (text or json):
    one stderr handler for the root, kvlens's and uvicorn's loggers (uvicorn's own handlers
    would print its lines in another format)."""
    level = level.upper()
    formatter = JsonFormatter if fmt == "json" else TextFormatter

    def own() -> dict[str, Any]:
        return {"handlers": ["stderr"], "level": level, "propagate": False}

    return {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {"kvlens": {"()": f"{__name__}.{formatter.__name__}"}},
        "handlers": {"stderr": {"()": f"{__name__}.StderrHandler", "formatter": "kvlens"}},
        "root": {"handlers": ["stderr"], "level": level},
        "loggers": {
            "uvicorn": own(),
            "uvicorn.error": {"level": level},  # propagates to "uvicorn"
            "uvicorn.access": own(),
            # httpx logs every request's URL at INFO, and a scrape URL's query may hold a secret.
            "httpx": {"level": "WARNING"},
            "httpcore": {"level": "WARNING"},
        },
    }
