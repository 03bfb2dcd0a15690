"""Logging for every service: one line per record on stderr, plain or JSON, tagged with the
service name and the request id of the gRPC call being served.

The request id lives in a ContextVar (set by the request-id interceptor) rather than being
passed around, so any library code that logs while serving a call is correlated for free. It
lives here, not in `interceptors`, so that this module does not import grpc.
"""

from __future__ import annotations

import json
import logging
import sys
from contextvars import ContextVar
from datetime import UTC, datetime
from typing import TextIO

from relayrl.core.config import LoggingConfig

REQUEST_ID: ContextVar[str | None] = ContextVar("relayrl_request_id", default=None)

PLAIN_FORMAT = "%(asctime)s %(levelname)s %(service)s %(name)s [%(request_id)s] %(message)s"
_STANDARD_ATTRS = frozenset(
    set(vars(logging.LogRecord("", 0, "", 0, "", None, None)))
    | {"message", "asctime", "request_id", "service", "taskName"}
)


def current_request_id() -> str | None:
    """The request id of the call being served in this context, if any."""
    return REQUEST_ID.get()


class ContextFilter(logging.Filter):
    """Stamps every record with the service name and the current request id ("-" outside a
    call), so formatters can rely on both attributes existing."""

    def __init__(self, service_name: str) -> None:
        super().__init__()
        self.service_name = service_name

    def filter(self, record: logging.LogRecord) -> bool:
        record.service = self.service_name
        record.request_id = REQUEST_ID.get() or "-"
        return True


class JsonFormatter(logging.Formatter):
    """One JSON object per line; fields passed with `extra=` become top-level keys so log
    queries can filter on e.g. `grpc_code` without parsing the message."""

    def format(self, record: logging.LogRecord) -> str:
        payload: dict[str, object] = {
            "ts": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "service": getattr(record, "service", None),
            "logger": record.name,
            "request_id": getattr(record, "request_id", None),
            "message": record.getMessage(),
        }
        payload.update(
            (key, value) for key, value in vars(record).items() if key not in _STANDARD_ATTRS
        )
        if record.exc_info:
            payload["exc_info"] = self.formatException(record.exc_info)
        if record.stack_info:
            payload["stack_info"] = self.formatStack(record.stack_info)
        return json.dumps(payload, default=str, ensure_ascii=False)


def setup_logging(
    config: LoggingConfig, service_name: str, stream: TextIO | None = None
) -> logging.Handler:
    """Route all records through one handler on `stream` (stderr by default).

    Calling it again replaces the handler it installed before instead of adding a second one,
    so tests and re-configuration do not duplicate lines."""
    root = logging.getLogger()
    for old in [h for h in root.handlers if getattr(h, "_relayrl_handler", False)]:
        root.removeHandler(old)
        old.close()
    handler = logging.StreamHandler(stream if stream is not None else sys.stderr)
    handler._relayrl_handler = True  # type: ignore[attr-defined]
    handler.addFilter(ContextFilter(service_name))
    handler.setFormatter(JsonFormatter() if config.json_lines else logging.Formatter(PLAIN_FORMAT))
    root.addHandler(handler)
    root.setLevel(config.level)
    return handler
