"""Logging for the sidecar: `--log-level`, and `--log-format text|json` (one JSON object a
line: time, level, logger, message, and any `extra=` fields)."""

from __future__ import annotations

import json
import logging
import time
from typing import Any, TextIO

LOG_FORMATS = ("text", "json")
_RECORD_FIELDS = set(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {"message", "asctime"}


class JsonFormatter(logging.Formatter):  # a dozen lines: not worth python-json-logger as a dependency
    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        out.update({k: v for k, v in vars(record).items() if k not in _RECORD_FIELDS})
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


def log_level(level: str, name: str = "--log-level") -> int:
    """The number of a level's name (any case). Raises ValueError naming `name` (the flag, or
    the variable it came from) for a name that is no level."""
    numeric = logging.getLevelName(level.upper())
    if not isinstance(numeric, int):
        raise ValueError(f"{name} must be DEBUG, INFO, WARNING, ERROR or CRITICAL, got {level!r}")
    return numeric


def configure_logging(level: str, fmt: str = "text", stream: TextIO | None = None) -> None:
    """Set up the root logger. Raises ValueError naming a bad level or format."""
    if fmt not in LOG_FORMATS:
        raise ValueError(f"--log-format must be one of {LOG_FORMATS}, got {fmt!r}")
    numeric = log_level(level)
    handler = logging.StreamHandler(stream)
    handler.setFormatter(
        JsonFormatter() if fmt == "json" else logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s")
    )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(numeric)


def announce(fmt: str, message: str, stream: TextIO, level: str = "INFO", **fields: Any) -> None:
    """A line the operator must see whatever the log level (the "serving on" banner, a
    start-up error): plain "hicache-server: ..." text, or one JSON object with --log-format json."""
    if fmt == "json":
        record = logging.LogRecord("hicache.server", logging.getLevelName(level), "", 0, message, None, None)
        record.__dict__.update(fields)
        print(JsonFormatter().format(record), file=stream, flush=True)
    else:
        print(f"hicache-server: {message}", file=stream, flush=True)
