"""Where the project's structlog events go when the application configured nothing.

structlog's own default prints to stdout, which an embedding program keeps for
its results (design §9). So importing any of the project's packages (this is
the one every other imports) routes structlog into the standard ``logging``
module, by logger name (``attention``, ``components``, ``lifecycle``): where the
application configured ``logging``, its handlers receive every event as one
logfmt line at the event's level; with no handler at all Python's last-resort
handler writes warnings and errors to stderr. An application that configured
structlog before the import keeps its configuration.

The project's hot paths ask the logger first (structlog's ``is_enabled_for``, the
standard logger's own level test here), so an event below the application's level
costs one check and builds no fields.
"""

from __future__ import annotations

import structlog

__all__: list[str] = []


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
        wrapper_class=structlog.stdlib.BoundLogger,
        logger_factory=structlog.stdlib.LoggerFactory(),
        cache_logger_on_first_use=True,
    )


if not structlog.is_configured():
    route_to_stdlib()
