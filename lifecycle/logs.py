"""Structured logs: quiet by default, into the standard ``logging`` module when embedded.

Every module logs with a constant event name and data fields (design §9);
this module only decides how those events are rendered and where they go.

- Unconfigured (a program embeds the orchestrator and configures nothing):
  the import routes structlog into the standard ``logging`` module
  (:mod:`attention.log_routing`, the package every other one imports), so
  nothing reaches stdout. An application that configured structlog first keeps
  its configuration.
- ``configure_logging`` (the CLI, ``serve``, the benchmarks, the tests): JSON
  lines or a console renderer on stderr, filtered at a level.

The project's modules log through ``get_logger``: one ``EventLogger`` per name,
which assembles its structlog logger on first use and asks it (structlog's own
``is_enabled_for``) whether a level is on, so that a call site builds its fields
only when the event will be written. Every change the project makes to structlog's
configuration goes through ``reconfigure``, which makes those loggers assemble
again: after it no event goes to a stream or a level of an earlier configuration.
"""

from __future__ import annotations

import contextvars
import logging
import sys
from collections.abc import Collection, Iterator, MutableMapping
from contextlib import contextmanager
from typing import Any, Literal, TextIO, TypeAlias

import msgspec
import structlog
from structlog.typing import FilteringBoundLogger, Processor

__all__ = [
    "MAY_WAIT",
    "REQUEST_ID",
    "LogFormat",
    "configure_logging",
    "get_logger",
    "reconfigure",
    "saved_logging",
]

LogFormat: TypeAlias = Literal["json", "console", "auto"]

_ENCODER = msgspec.json.Encoder(enc_hook=str)


def _encode_json(event: Any, **_: Any) -> str:
    # structlog passes json.dumps-style keyword arguments; msgspec needs none
    # and writes Enums as their values.
    return _ENCODER.encode(event).decode()


class EventLogger:
    """A named event logger whose filtered events cost one level check.

    Its structlog logger is assembled on first use from structlog's configuration
    (so an application may configure structlog after importing the project, as
    long as it does so before the first event), and again after every ``reconfigure``.

    Args:
        name: the standard ``logging`` name events go to when unconfigured.
    """

    __slots__ = ("_logger", "_name")

    def __init__(self, name: str) -> None:
        self._name = name
        self._logger: FilteringBoundLogger | None = None

    def is_enabled_for(self, level: int) -> bool:
        """Tell whether an event at ``level`` would be written: build costly fields only then."""
        logger = self._logger
        if logger is None:
            logger = self._assemble()
        return logger.is_enabled_for(level)

    def debug(self, event: str, **fields: Any) -> None:
        """Log ``event`` at debug level."""
        logger = self._current()
        if logger.is_enabled_for(logging.DEBUG):
            logger.debug(event, **fields)

    def info(self, event: str, **fields: Any) -> None:
        """Log ``event`` at info level."""
        logger = self._current()
        if logger.is_enabled_for(logging.INFO):
            logger.info(event, **fields)

    def warning(self, event: str, **fields: Any) -> None:
        """Log ``event`` at warning level."""
        logger = self._current()
        if logger.is_enabled_for(logging.WARNING):
            logger.warning(event, **fields)

    def error(self, event: str, **fields: Any) -> None:
        """Log ``event`` at error level."""
        logger = self._current()
        if logger.is_enabled_for(logging.ERROR):
            logger.error(event, **fields)

    def _current(self) -> FilteringBoundLogger:
        logger = self._logger
        return self._assemble() if logger is None else logger

    def _assemble(self) -> FilteringBoundLogger:
        logger: FilteringBoundLogger = structlog.get_logger(self._name).bind()
        self._logger = logger
        return logger

    def _forget(self) -> None:
        self._logger = None


_LOGGERS: dict[str, EventLogger] = {}


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

MAY_WAIT = context_variable("may_wait")
"""True while a stage tries to onload: a refusal then may mean a wait
(``lifecycle.device.waiting``)."""


def get_logger(name: str) -> EventLogger:
    """Return the event logger of the project module family ``name`` (e.g. ``lifecycle``)."""
    logger = _LOGGERS.get(name)
    if logger is None:
        logger = _LOGGERS.setdefault(name, EventLogger(name))
    return logger


def reconfigure(**settings: Any) -> None:
    """Change structlog's configuration (``structlog.configure``'s keywords) for the project.

    The one place the project changes it: the project's loggers assemble again from
    the new configuration on their next event, so none keeps writing to a stream, a
    level or processors the configuration no longer names.
    """
    structlog.configure(**settings)
    for logger in list(_LOGGERS.values()):
        logger._forget()


@contextmanager
def saved_logging() -> Iterator[None]:
    """Put structlog's configuration back on exit as it was on entry.

    For code that configures logging for a while (a test, the CLI run in-process).
    """
    saved = structlog.get_config()
    try:
        yield
    finally:
        reconfigure(**saved)


def configure_logging(
    fmt: LogFormat = "auto",
    level: str = "info",
    stream: TextIO | None = None,
    *,
    omit: Collection[str] = (),
    omit_on_console: Collection[str] = (),
) -> None:
    """Route every structlog event to ``stream`` (stderr by default).

    ``auto`` renders for a person when the stream is a terminal and as JSON
    lines otherwise. Tracebacks never carry frame locals, which may hold
    secrets. The project's loggers follow a later call; structlog's own cached
    loggers (``cache_logger_on_first_use``) do not, so call it before the first
    event.

    Args:
        fmt: ``json``, ``console`` or ``auto``.
        level: the least severe level written (``debug``, ``info``, ``warning``, ``error``).
        stream: where events go; stderr by default.
        omit: event names left out whatever the rendering (the command prints the
            same on stdout, and a stream that captures both would carry it twice).
        omit_on_console: event names left out when rendering for a person (the
            command says the same in its own words); JSON lines keep them.

    Raises:
        ValueError: ``level`` is not a logging level name.
    """
    out = sys.stderr if stream is None else stream
    numeric_level = logging.getLevelNamesMapping().get(level.upper())
    if numeric_level is None:
        raise ValueError(f"unknown log level {level!r}; use debug, info, warning or error")
    console = fmt == "console" or (fmt == "auto" and out.isatty())
    names = frozenset(omit) | (frozenset(omit_on_console) if console else frozenset())
    omitted: list[Processor] = [_Omit(names)] if names else []
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
    reconfigure(
        processors=[*omitted, *shared, *renderer],
        wrapper_class=structlog.make_filtering_bound_logger(numeric_level),
        logger_factory=structlog.PrintLoggerFactory(file=out),
        cache_logger_on_first_use=True,
    )


class _Omit:
    """A processor that drops the events named in ``names``."""

    def __init__(self, names: frozenset[str]) -> None:
        self.names = names

    def __call__(
        self, logger: Any, method_name: str, event_dict: MutableMapping[str, Any]
    ) -> MutableMapping[str, Any]:
        if event_dict.get("event") in self.names:
            raise structlog.DropEvent
        return event_dict
