"""Structured log lines: one JSON object per line, so a cluster's log pipeline can index the fields.

Fields passed as ``extra={"pod": ..., "node": ...}`` become keys of the object; the message stays a
sentence a person can read. ``--log-format text`` gives the same lines for a terminal.
"""

from __future__ import annotations

import json
import logging
import sys
from datetime import UTC, datetime

#: Loggers that write a line per HTTP request.
_PER_REQUEST_LOGGERS = ("httpx2", "httpcore2", "httpx", "httpcore")

_STANDARD = set(logging.LogRecord("", 0, "", 0, "", None, None).__dict__) | {"message", "asctime"}


class JsonFormatter(logging.Formatter):
    def __init__(self, *, component: str) -> None:
        super().__init__()
        self._component = component

    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, object] = {
            "ts": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname.lower(),
            "component": self._component,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        for key, value in record.__dict__.items():
            if key not in _STANDARD and not key.startswith("_"):
                line[key] = value
        if record.exc_info:
            line["exc"] = self.formatException(record.exc_info)
        return json.dumps(line, default=str)


def configure_logging(*, component: str, level: str = "info", fmt: str = "json") -> None:
    handler = logging.StreamHandler(sys.stderr)
    if fmt == "json":
        handler.setFormatter(JsonFormatter(component=component))
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    # The HTTP client logs every request at info: one line per bind, Event and watch is a cost per pod
    # in a burst, and says nothing an operator reads. Its warnings still come through.
    for noisy in _PER_REQUEST_LOGGERS:
        logging.getLogger(noisy).setLevel(max(logging.WARNING, root.level))
