"""Problems a folder's pipeline has that admission refuses: a code, where, what, the fix."""

from __future__ import annotations

from typing import NamedTuple

__all__ = ["Problem"]


class Problem(NamedTuple):
    """Something about a pipeline folder that admission refuses, with its fix.

    Attributes:
        code: the refusal code it is reported under (``pipeline.custom_code``); the
            lifecycle's ``RefusalCode`` holds every one.
        component: the component it concerns (``pipeline`` for the folder as a whole).
        message: what is wrong, with the names and numbers.
        hint: what to change.
    """

    code: str
    component: str
    message: str
    hint: str
