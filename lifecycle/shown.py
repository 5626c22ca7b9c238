"""A value that an error or a log line repeats, cut short.

A client may send a name of any length (an ``attention_backend``, a ``model``, an
adapter in ``lora``, a ``size``, an ``x-request-id``), and a config a value of any
length; an error that repeats it whole grows with it (a 100,000-character
``attention_backend`` made a 200 KB answer and a 100 KB log line). Every error and
log line that repeats such a value passes it through ``shown``.
"""

from __future__ import annotations

__all__ = ["SHOWN_CHARS", "shown"]

SHOWN_CHARS = 40
"""How many characters of a value's ``repr`` an error repeats."""


def shown(value: object) -> str:
    """Return ``repr(value)``, cut to its first ``SHOWN_CHARS`` characters and ``...``."""
    text = repr(value)
    return text if len(text) <= SHOWN_CHARS else text[:SHOWN_CHARS] + "..."
