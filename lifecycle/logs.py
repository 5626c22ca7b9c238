"""Structured logs: JSON lines for ops, a readable console for people.

Every module logs through ``structlog.get_logger(...)`` with a constant event
name and data fields (DESIGN.md §9); this module only decides how those
events are rendered and where they go (stderr: stdout carries results).
"""

from __future__ import annotations

import logging
import sys
from typing import Any, Literal, TextIO, TypeAlias

import msgspec
import structlog
from structlog.typing import Processor

LogFormat: TypeAlias = Literal["json", "console", "auto"]

_ENCODER = msgspec.json.Encoder(enc_hook=str)


def _encode_json(event: Any, **_: Any) -> str:
    # structlog passes json.dumps-style keyword arguments; msgspec needs none
    # and writes Enums as their values.
    return _ENCODER.encode(event).decode()


def configure_logging(
    fmt: LogFormat = "auto", level: str = "info", stream: TextIO | None = None
) -> None:
    """Route every structlog event to ``stream`` (stderr by default).

    ``auto`` renders for a person when the stream is a terminal and as JSON
    lines otherwise. Tracebacks never carry frame locals, which may hold
    secrets.

    Raises:
        ValueError: ``level`` is not a logging level name.
    """
    out = sys.stderr if stream is None else stream
    numeric_level = logging.getLevelNamesMapping().get(level.upper())
    if numeric_level is None:
        raise ValueError(f"unknown log level {level!r}; use debug, info, warning or error")
    console = fmt == "console" or (fmt == "auto" and out.isatty())
    shared: list[Processor] = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    renderer: list[Processor] = (
        [
            structlog.dev.ConsoleRenderer(
                colors=out.isatty(), exception_formatter=structlog.dev.plain_traceback
            )
        ]
        if console
        else [
            structlog.processors.ExceptionRenderer(
                structlog.tracebacks.ExceptionDictTransformer(show_locals=False)
            ),
            structlog.processors.JSONRenderer(serializer=_encode_json),
        ]
    )
    structlog.configure(
        processors=[*shared, *renderer],
        wrapper_class=structlog.make_filtering_bound_logger(numeric_level),
        logger_factory=structlog.PrintLoggerFactory(file=out),
        cache_logger_on_first_use=False,
    )
