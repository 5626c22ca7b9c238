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

A *lead* ``L`` lets *ready* items go early: those whose turn costs the others nothing
(stages whose components are all resident already; the memory waiter's ``LEAD``,
while the job queue has none). One may be served before the items ahead of it when
its effective priority plus ``L`` exceeds each of theirs (on a tie, the earlier
arrival goes first) and none of those that are not ready has a higher priority.
Every one that may goes at once, in no set order, and the first in line waits for
them (see ``may_go``). Whoever is served is then within ``L`` of every item it
passes, so the argument above holds with ``P + L`` for ``P``: the bound is
``(P + L - p) + (W - 1)``, with ``W`` the requests waiting once ``P + L - p`` turns
have passed it over.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Container, Iterator, Sequence
from typing import Generic, NamedTuple, TypeVar

__all__ = ["PriorityQueue"]

T = TypeVar("T")


class Place(NamedTuple, Generic[T]):
    """Where one item waits: the queue is sorted on ``(rank, arrival)``.

    Attributes:
        rank: the turns served before it arrived, less its priority.
        arrival: how many items were queued before it, ever.
        priority: the priority it was queued with.
        item: what waits.
    """

    rank: int
    arrival: int
    priority: int
    item: T


def may_go(places: Sequence[Place[T]], ready: Container[T], lead: int) -> list[T]:
    """Return the items of ``places`` (sorted on rank, then arrival) that may be served now,
    first in line first.

    A *ready* item (one whose turn costs the others nothing: a stage whose components
    are all resident already) may when it is first in line, or less than ``lead`` turns
    of ageing behind every item ahead of it (on a tie, the earlier arrival goes first)
    with at least the priority of each of those that is not ready. Only when none may
    does the first in line go: it may need a move that would undo theirs. With ``lead``
    0 or nothing ready, only the first may.
    """
    head = places[0]
    going: list[T] = []
    highest: int | None = None  # the highest priority of those not ready so far
    for place in places:
        if place is not head and (place.rank - lead, place.arrival) >= (head.rank, head.arrival):
            break  # it is ``lead`` turns behind the first, and so is every one after it
        if place.item not in ready:
            highest = place.priority if highest is None else max(highest, place.priority)
        elif highest is None or place.priority >= highest:
            going.append(place.item)
    return going or [head.item]


class PriorityQueue(Generic[T]):
    """Waiting items in the order they are served (the module says the rule and its bound).

    Attributes:
        turns: turns served so far (a batch started, a stage granted).
    """

    def __init__(self) -> None:
        self._places: list[Place[T]] = []
        self._arrivals = itertools.count()
        self.turns = 0

    def push(self, item: T, priority: int) -> None:
        """Queue ``item`` with ``priority``."""
        place = Place(self.turns - priority, next(self._arrivals), priority, item)
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

    def going(self, ready: Container[T], lead: int) -> list[T]:
        """Return the items that may be served now, ``ready`` ones going up to ``lead``
        turns ahead (``may_go``), first in line first.

        Raises:
            IndexError: the queue is empty.
        """
        return may_go(self._places, ready, lead)

    def __iter__(self) -> Iterator[T]:
        """Yield the queued items, the next to be served first."""
        return (place.item for place in self._places)

    def __len__(self) -> int:
        return len(self._places)
