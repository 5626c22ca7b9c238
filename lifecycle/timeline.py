"""The request timeline: the declared order of stages and what it says of each use."""

from __future__ import annotations

import math
from collections.abc import Sequence

from lifecycle.config import StageSpec


class Timeline:
    """The stages of a request in declared order, and the uses they make.

    A request may enter any declared stage in any order; the declared order is
    what "next use" and "last use" are measured against.
    """

    def __init__(self, stages: Sequence[StageSpec]) -> None:
        self.stages = tuple(stages)
        self._index = {stage.name: i for i, stage in enumerate(self.stages)}

    def index(self, stage: str) -> int:
        """Return the position of ``stage``.

        Raises:
            KeyError: no stage has that name; the message lists the stages.
        """
        try:
            return self._index[stage]
        except KeyError:
            known = ", ".join(self._index) or "none"
            raise KeyError(f"no stage named {stage!r}; stages: {known}") from None

    def next_use(self, component: str, after: int) -> int | None:
        """Return the position of the first stage after ``after`` that uses ``component``."""
        for position in range(after + 1, len(self.stages)):
            if component in self.stages[position].uses:
                return position
        return None

    def distance_to_next_use(self, component: str, after: int) -> float:
        """Return how many stages away the next use is; infinite when there is none."""
        position = self.next_use(component, after)
        return math.inf if position is None else position - after

    def is_used(self, component: str) -> bool:
        """Tell whether any stage uses ``component``."""
        return any(component in stage.uses for stage in self.stages)
