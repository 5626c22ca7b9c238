"""The order in which waiting requests are served: higher priority first, FIFO within
a priority, with ageing so that none waits without bound (design §15).

Two queues follow it: a serving worker's job queue (``lifecycle.serving.batcher``,
where a *turn* is a batch starting) and the stages waiting for memory
(``lifecycle.device.waiting``, where a turn is a stage granted its components).

Every turn served to another while a request waits *passes it over* and ages it by
one: its effective priority is its ``priority`` plus the turns served since it
arrived. The next turn goes to the highest effective priority, the earliest arrival
on a tie. Since every waiting request ages alike, the order between two of them
never changes while both wait: each keeps one rank, ``turns served before it
arrived - priority``, and the queue stays sorted on (rank, arrival).

The bound: a request of priority ``p`` is passed over at most ``(P - p) + (W - 1)``
times, where ``P`` is the highest priority a request may carry
(``serving.max_priority``) and ``W`` the requests waiting once ``P - p`` turns have
passed it over. One that arrived after ``d`` of those turns has aged ``d`` less, so
it is served first only if its priority exceeds ``p + d``: once ``d >= P - p``
none can, and only those already waiting are served first, each once. In a worker,
with ``serving.max_queue`` jobs per priority, ``W <= (P + 1) * max_queue``.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Iterator
from typing import Generic, NamedTuple, TypeVar

T = TypeVar("T")


class _Place(NamedTuple, Generic[T]):
    rank: int
    arrival: int
    item: T


class PriorityQueue(Generic[T]):
    """Waiting items in the order they are served (the module says the rule and its bound).

    Attributes:
        turns: turns served so far (a batch started, a stage granted).
    """

    def __init__(self) -> None:
        self._places: list[_Place[T]] = []
        self._arrivals = itertools.count()
        self.turns = 0

    def push(self, item: T, priority: int) -> None:
        """Queue ``item`` with ``priority``."""
        place = _Place(self.turns - priority, next(self._arrivals), item)
        bisect.insort(self._places, place, key=lambda p: (p.rank, p.arrival))

    def remove(self, item: T) -> None:
        """Take ``item`` out of the queue (it is served, or was cancelled).

        Raises:
            ValueError: ``item`` is not queued.
        """
        del self._places[self.position(item)]

    def position(self, item: T) -> int:
        """Return how many items are served before ``item``.

        Raises:
            ValueError: ``item`` is not queued.
        """
        for index, place in enumerate(self._places):
            if place.item is item:
                return index
        raise ValueError("the item is not queued")

    def served(self) -> None:
        """Count one turn served: every item still queued was passed over and ages by one."""
        self.turns += 1

    def head(self) -> T:
        """Return the item served next.

        Raises:
            IndexError: the queue is empty.
        """
        return self._places[0].item

    def __iter__(self) -> Iterator[T]:
        """Yield the queued items, the next to be served first."""
        return (place.item for place in self._places)

    def __len__(self) -> int:
        return len(self._places)
