"""The request timeline: the declared order of stages and what it says of each use."""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence

from lifecycle.spec.structs import StageSpec

__all__ = ["Timeline"]


class Timeline:
    """The stages of a request in declared order, and the uses they make.

    A request may enter any declared stage in any order; the declared order is
    what "next use" and "last use" are measured against. Every answer is read
    from tables built once here, so that a move costs the same whatever the
    number of stages and components.

    Attributes:
        stages: the stages, in declared order.
        first_expert: the first windowed use of the first stage with step windows, with
            that stage's position, where a stage follows it (Wan 2.2 A14B's
            ``transformer`` in ``denoise``): a request's last stage prefetches it for the
            next request; None without windows.
    """

    def __init__(self, stages: Sequence[StageSpec]) -> None:
        self.stages = tuple(stages)
        self._index = {stage.name: i for i, stage in enumerate(self.stages)}
        positions: dict[str, list[int]] = {}
        for position, stage in enumerate(self.stages):
            for name in dict.fromkeys(stage.uses):
                positions.setdefault(name, []).append(position)
        self._positions = {name: tuple(found) for name, found in positions.items()}
        # a windowed use is needed after those before it in its stage (the second expert
        # after the first): a fraction of a stage further, so that the budget evicts the
        # later one first
        self._later = {
            (name, p): i / len(stage.windows)
            for p, stage in enumerate(self.stages)
            for i, name in enumerate(n for n in stage.uses if n in stage.windows)
        }
        self._last_uses = tuple(
            tuple(n for n in dict.fromkeys(stage.uses) if self.next_use(n, p) is None)
            for p, stage in enumerate(self.stages)
        )
        # what a stage holds on entry: with step windows, the first windowed use alone
        self._entered = tuple(stage.held_together()[0] for stage in self.stages)
        # the first windowed use of the first stage with windows (the first expert), with
        # that stage's position, where a later stage can run while it is prefetched
        self.first_expert: tuple[int, str] | None = None
        for p, stage in enumerate(self.stages[:-1]):
            if stage.windows:
                self.first_expert = (p, next(n for n in stage.uses if n in stage.windows))
                break
        self._added_next = tuple(
            tuple(n for n in self._entered[p + 1] if n not in stage.uses)
            if p + 1 < len(self.stages)
            else ()
            for p, stage in enumerate(self.stages)
        )

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
        positions = self._positions.get(component, ())
        found = bisect.bisect_right(positions, after)
        return positions[found] if found < len(positions) else None

    def distance_to_next_use(self, component: str, after: int) -> float:
        """Return how many stages away the next use is; infinite when there is none.

        A windowed use comes a fraction of a stage after the windowed uses before it in
        its stage (``transformer_2`` 1.5 stages away where ``transformer`` is 1).
        """
        position = self.next_use(component, after)
        if position is None:
            return math.inf
        return position - after + self._later.get((component, position), 0.0)

    def is_used(self, component: str) -> bool:
        """Tell whether any stage uses ``component``."""
        return component in self._positions

    def last_uses(self, position: int) -> tuple[str, ...]:
        """Return the components the stage at ``position`` uses for the last time."""
        return self._last_uses[position]

    def entered(self, position: int) -> tuple[str, ...]:
        """Return the uses the stage at ``position`` holds on entry: all of them, or with
        step windows the uses without one and the first windowed use."""
        return self._entered[position]

    def added_next(self, position: int) -> tuple[str, ...]:
        """Return the components the stage after ``position`` adds to it (none after the last)."""
        return self._added_next[position]
