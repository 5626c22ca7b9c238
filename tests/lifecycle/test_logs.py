"""Log rendering: JSON lines for ops, no frame locals, results kept off the log stream."""

from __future__ import annotations

import io
import json
from collections.abc import Iterator

import pytest
import structlog

from lifecycle.logs import configure_logging
from lifecycle.states import ComponentState


@pytest.fixture(autouse=True)
def restore_structlog() -> Iterator[None]:
    """Put structlog's configuration back after each test."""
    saved = structlog.get_config()
    yield
    structlog.configure(**saved)


class TestConfigureLogging:
    def test_json_lines_carry_the_fields(self) -> None:
        """A JSON event is one line with level, timestamp, context and Enum values."""
        stream = io.StringIO()
        configure_logging("json", "info", stream)
        with structlog.contextvars.bound_contextvars(request_id="r1"):
            structlog.get_logger().info("lifecycle.transition", dest=ComponentState.RESIDENT)
        (line,) = stream.getvalue().splitlines()
        event = json.loads(line)
        assert event["event"] == "lifecycle.transition"
        assert event["dest"] == "resident"
        assert event["request_id"] == "r1"
        assert event["level"] == "info"
        assert event["timestamp"].endswith("Z")

    def test_level_filters(self) -> None:
        """Events below the configured level are dropped."""
        stream = io.StringIO()
        configure_logging("json", "warning", stream)
        structlog.get_logger().info("quiet")
        structlog.get_logger().warning("loud")
        assert [json.loads(line)["event"] for line in stream.getvalue().splitlines()] == ["loud"]

    def test_tracebacks_carry_no_locals(self) -> None:
        """An exception is rendered as data without any frame's local variables."""
        stream = io.StringIO()
        configure_logging("json", "info", stream)
        secret = "hunter2"
        try:
            raise RuntimeError("boom")
        except RuntimeError:
            structlog.get_logger().exception("lifecycle.failed", token_len=len(secret))
        assert "hunter2" not in stream.getvalue()
        event = json.loads(stream.getvalue())
        assert event["exception"][0]["exc_value"] == "boom"

    def test_console_is_readable(self) -> None:
        """The console renderer writes the event name and its fields as text."""
        stream = io.StringIO()
        configure_logging("console", "info", stream)
        structlog.get_logger().info("residency.moved", component="vae")
        assert "residency.moved" in stream.getvalue()
        assert "component=vae" in stream.getvalue()

    def test_unknown_level_is_refused(self) -> None:
        """A level name that logging does not know is a clear error."""
        with pytest.raises(ValueError, match="unknown log level 'loud'"):
            configure_logging("json", "loud")
