"""Structured logs: quiet by default, into the standard ``logging`` module when embedded.

Every module logs with a constant event name and data fields (DESIGN.md §9);
this module only decides how those events are rendered and where they go.

- Unconfigured (a program embeds the orchestrator and configures nothing):
  the import routes structlog into the standard ``logging`` module
  (:mod:`attention.log_routing`, the package every other one imports), so
  nothing reaches stdout.
- ``configure_logging`` (the CLI, the benchmarks): JSON lines or a console
  renderer on stderr, filtered at a level.

The project's hot paths log through ``get_logger``: an ``EventLogger`` keeps
its assembled structlog logger until the configuration changes, and answers
``is_enabled_for`` so that a call site builds its fields only when the event
will be written.
"""

from __future__ import annotations

import contextvars
import logging
import sys
from collections.abc import Callable
from typing import Any, Literal, TextIO, TypeAlias

import msgspec
import structlog
from structlog.typing import Processor

from attention.log_routing import StdlibEventLogger

LogFormat: TypeAlias = Literal["json", "console", "auto"]

_ENCODER = msgspec.json.Encoder(enc_hook=str)


def _encode_json(event: Any, **_: Any) -> str:
    # structlog passes json.dumps-style keyword arguments; msgspec needs none
    # and writes Enums as their values.
    return _ENCODER.encode(event).decode()


class _Generation:
    """Counts configuration changes, so that cached loggers know when to reassemble."""

    value = 0


def configuration_changed() -> None:
    """Make every ``EventLogger`` assemble its logger again from structlog's configuration."""
    _Generation.value += 1


def _always(level: int) -> bool:
    return True


class EventLogger:
    """A named event logger whose filtered events cost one level check.

    The assembled structlog logger is cached on first use and assembled again
    after ``configure_logging``, ``capture_events`` or ``configuration_changed``
    (as with structlog's own
    ``cache_logger_on_first_use``, an application that calls
    ``structlog.configure`` should do so before the first event).

    Args:
        name: the standard ``logging`` name events go to when unconfigured.
    """

    __slots__ = ("_enabled", "_generation", "_logger", "_name")

    def __init__(self, name: str) -> None:
        self._name = name
        self._generation = -1
        self._logger: Any = None
        self._enabled: Callable[[int], bool] = _always

    def is_enabled_for(self, level: int) -> bool:
        """Tell whether an event at ``level`` would be written: build costly fields only then."""
        if self._generation != _Generation.value:
            self._assemble()
        return self._enabled(level)

    def debug(self, event: str, **fields: Any) -> None:
        """Log ``event`` at debug level."""
        if self.is_enabled_for(logging.DEBUG):
            self._logger.debug(event, **fields)

    def info(self, event: str, **fields: Any) -> None:
        """Log ``event`` at info level."""
        if self.is_enabled_for(logging.INFO):
            self._logger.info(event, **fields)

    def warning(self, event: str, **fields: Any) -> None:
        """Log ``event`` at warning level."""
        if self.is_enabled_for(logging.WARNING):
            self._logger.warning(event, **fields)

    def error(self, event: str, **fields: Any) -> None:
        """Log ``event`` at error level."""
        if self.is_enabled_for(logging.ERROR):
            self._logger.error(event, **fields)

    def _assemble(self) -> None:
        self._logger = structlog.get_logger(self._name).bind()
        if isinstance(self._logger, StdlibEventLogger):
            # the standard logger's test itself: one call less on every event (issue 12)
            self._enabled = self._logger.level_check
        else:
            check = getattr(self._logger, "is_enabled_for", None)
            self._enabled = _always if check is None else check
        self._generation = _Generation.value


def context_variable(key: str) -> contextvars.ContextVar[Any]:
    """Return the context variable behind the structlog context key ``key``.

    Setting it, and resetting it by its token, binds ``key`` on every event
    exactly as ``structlog.contextvars.bound_contextvars`` does, at a fraction
    of the cost: that one first copies the whole context, several microseconds
    on every stage of a request (issue 12). An unbound key holds ``...``
    (structlog's mark for "not bound").
    """
    tokens = structlog.contextvars.bind_contextvars(**{key: ...})
    var = tokens[key].var
    var.reset(tokens[key])
    return var


REQUEST_ID = context_variable("request_id")
"""The ``request_id`` every event inside a request carries (``...`` outside one)."""


def get_logger(name: str) -> EventLogger:
    """Return an event logger for the project module family ``name`` (e.g. ``lifecycle``)."""
    return EventLogger(name)


def configure_logging(
    fmt: LogFormat = "auto", level: str = "info", stream: TextIO | None = None
) -> None:
    """Route every structlog event to ``stream`` (stderr by default).

    ``auto`` renders for a person when the stream is a terminal and as JSON
    lines otherwise. Tracebacks never carry frame locals, which may hold
    secrets. Loggers are cached on first use: the project's own follow a later
    call, but call it before the first event so that every other does too.

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
        cache_logger_on_first_use=True,
    )
    configuration_changed()
