"""Log lines carry the service and the current request id, as text or JSON."""

from __future__ import annotations

import contextvars
import io
import json
import logging
from collections.abc import Iterator

import pytest

from relayrl.core.config import LoggingConfig
from relayrl.core.logs import REQUEST_ID, setup_logging


@pytest.fixture
def root_logger() -> Iterator[logging.Logger]:
    """Restore the root logger afterwards: setup_logging configures process-wide logging."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield root
    for handler in list(root.handlers):
        if handler not in handlers:
            root.removeHandler(handler)
    root.setLevel(level)


def in_call(request_id: str, fn: object) -> None:
    """Run `fn` the way a served call runs: in its own context with the request id set."""

    def call() -> None:
        REQUEST_ID.set(request_id)
        fn()  # type: ignore[operator]

    contextvars.copy_context().run(call)


def test_json_lines_include_request_id_and_extra_fields(root_logger: logging.Logger) -> None:
    stream = io.StringIO()
    setup_logging(LoggingConfig(json=True), "reward", stream)
    log = logging.getLogger("relayrl.test")
    in_call("req-1", lambda: log.info("scored %d items", 3, extra={"batch_size": 3}))
    log.warning("outside a call")

    first, second = (json.loads(line) for line in stream.getvalue().splitlines())
    assert first["message"] == "scored 3 items"
    assert first["request_id"] == "req-1"
    assert first["service"] == "reward"
    assert first["level"] == "INFO"
    assert first["batch_size"] == 3
    assert second["request_id"] == "-"


def test_json_lines_keep_tracebacks_on_one_line(root_logger: logging.Logger) -> None:
    stream = io.StringIO()
    setup_logging(LoggingConfig(json=True), "reward", stream)
    try:
        raise RuntimeError("boom")
    except RuntimeError:
        logging.getLogger("relayrl.test").exception("failed")
    (line,) = stream.getvalue().splitlines()
    assert "RuntimeError: boom" in json.loads(line)["exc_info"]


def test_plain_lines_show_service_and_request_id(root_logger: logging.Logger) -> None:
    stream = io.StringIO()
    setup_logging(LoggingConfig(), "trainer", stream)
    in_call("req-9", lambda: logging.getLogger("relayrl.test").info("step done"))
    line = stream.getvalue().strip()
    assert " INFO trainer relayrl.test [req-9] step done" in line


def test_level_filters_and_setup_twice_does_not_duplicate(root_logger: logging.Logger) -> None:
    stream = io.StringIO()
    setup_logging(LoggingConfig(), "trainer", stream)
    setup_logging(LoggingConfig(level="warning"), "trainer", stream)
    log = logging.getLogger("relayrl.test")
    log.info("hidden")
    log.warning("shown")
    assert stream.getvalue().count("shown") == 1
    assert "hidden" not in stream.getvalue()
