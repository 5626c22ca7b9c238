"""Where the project's structlog events go when the application configured nothing.

structlog's own default prints to stdout, which an embedding program keeps for
its results (DESIGN §9). So importing any of the project's packages (this is
the one every other imports) routes structlog into the standard ``logging``
module, by logger name (``attention``, ``components``, ``lifecycle``): where the
application configured ``logging``, its handlers receive every event as one
logfmt line at the event's level; with no handler at all Python's last-resort
handler writes warnings and errors to stderr. An application that configured
structlog before the import keeps its configuration.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import structlog

_LEVELS = {
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "warning": logging.WARNING,
    "error": logging.ERROR,
    "exception": logging.ERROR,
    "critical": logging.CRITICAL,
}


class StdlibEventLogger(structlog.stdlib.BoundLogger):
    """A structlog logger over a standard ``logging`` logger that can say if a level is on.

    While ``filter_by_level`` leads the processors (always, except while a test
    captures events), an event below the standard logger's level is dropped
    before its event dictionary is even built: the same decision, taken first.
    """

    def is_enabled_for(self, level: int) -> bool:
        """Tell whether the standard logger would handle an event at ``level``."""
        return self.level_check(level)

    @property
    def level_check(self) -> Callable[[int], bool]:
        """Return the standard logger's own level test (it follows later ``setLevel`` calls)."""
        logger: logging.Logger = self._logger
        return logger.isEnabledFor

    def _proxy_to_logger(
        self, method_name: str, event: str | None = None, *event_args: str, **event_kw: Any
    ) -> Any:
        level = _LEVELS.get(method_name)
        if (
            level is not None
            and next(iter(self._processors), None) is structlog.stdlib.filter_by_level
            and not self.is_enabled_for(level)
        ):
            return None
        return super()._proxy_to_logger(method_name, event, *event_args, **event_kw)


def route_to_stdlib() -> None:
    """Send every structlog event to the standard ``logging`` logger of its name.

    Levels and handlers are the application's: an event below its logger's
    effective level is dropped before any field is rendered.
    """
    structlog.configure(
        processors=[
            structlog.stdlib.filter_by_level,
            structlog.contextvars.merge_contextvars,
            structlog.processors.LogfmtRenderer(key_order=["event"], drop_missing=True),
        ],
        wrapper_class=StdlibEventLogger,
        logger_factory=structlog.stdlib.LoggerFactory(),
        cache_logger_on_first_use=True,
    )


if not structlog.is_configured():
    route_to_stdlib()
