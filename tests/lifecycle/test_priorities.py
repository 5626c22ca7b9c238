"""The order of waiting requests (``lifecycle.device.priorities``): priority, FIFO, ageing,
and the lead of items whose turn costs nothing."""

from __future__ import annotations

import itertools
import random
from collections.abc import Sequence

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lifecycle.device.priorities import Place, PriorityQueue, may_go

MAX_PRIORITY = 5


def allowed(places: Sequence[Place[int]], ready: set[int], lead: int) -> list[int]:
    """Return, as the rule is written, the items that may be served now: the ready ones
    that are first in line, or less than ``lead`` turns of ageing behind every item ahead
    of them (on a tie, the earlier arrival) with at least the priority of every one of
    those that is not ready; when there are none, the first in line."""
    found = [
        place.item
        for index, place in enumerate(places)
        if place.item in ready
        and all((place.rank - lead, place.arrival) < (a.rank, a.arrival) for a in places[:index])
        and all(place.priority >= a.priority for a in places[:index] if a.item not in ready)
    ]
    return found or [places[0].item]


def small_queues() -> list[tuple[list[Place[int]], set[int]]]:
    """Every queue of up to 4 items arriving over 3 turns with priorities 0 to 2, with
    every subset of them ready."""
    found = []
    for size in range(1, 5):
        for turns in itertools.combinations_with_replacement(range(3), size):
            for priorities in itertools.product(range(3), repeat=size):
                places = sorted(
                    (
                        Place(turn - priority, item, priority, item)
                        for item, (turn, priority) in enumerate(zip(turns, priorities, strict=True))
                    ),
                    key=lambda p: (p.rank, p.arrival),
                )
                for mask in range(2**size):
                    found.append((places, {item for item in range(size) if mask >> item & 1}))
    return found


class TestPriorityQueue:
    def test_fifo_within_one_priority(self) -> None:
        """Items of one priority are served in arrival order."""
        queue: PriorityQueue[str] = PriorityQueue()
        for name in "abcd":
            queue.push(name, 0)
        assert list(queue) == ["a", "b", "c", "d"]

    def test_higher_priority_first(self) -> None:
        """A later item of higher priority is served before earlier lower ones."""
        queue: PriorityQueue[str] = PriorityQueue()
        queue.push("low1", 0)
        queue.push("low2", 0)
        queue.push("high", 3)
        assert queue.head() == "high"
        assert queue.position("low2") == 2

    def test_passed_over_items_age(self) -> None:
        """Each turn served to another ages the waiting ones: a newcomer must outrank that."""
        queue: PriorityQueue[str] = PriorityQueue()
        queue.push("old", 0)
        for _ in range(3):
            queue.served()
        queue.push("newer, priority 3", 3)  # ties with old's age: old arrived first
        queue.push("newer, priority 4", 4)
        assert list(queue) == ["newer, priority 4", "old", "newer, priority 3"]

    def test_ageing_bound_holds_in_a_long_mixed_run(self) -> None:
        """Over 2,000 turns of random arrivals no item is passed over more than the bound,
        and once it has aged MAX_PRIORITY - p no later arrival is served before it."""
        rng = random.Random(22)
        queue: PriorityQueue[int] = PriorityQueue()
        priority: dict[int, int] = {}
        arrived: dict[int, int] = {}  # the turns served when it arrived
        served: dict[int, int] = {}  # the turn it was served in
        items = iter(range(10**9))
        for _ in range(2_000):
            for _ in range(rng.choice((0, 0, 1, 1, 2))):  # about one arrival a turn
                item = next(items)
                priority[item] = rng.choice((0, 0, 0, 0, 1, 2, 3, 4, 5))
                arrived[item] = queue.turns
                queue.push(item, priority[item])
            if len(queue):
                head = queue.head()
                queue.remove(head)
                served[head] = queue.turns
                queue.served()
        never = queue.turns + 1
        # every item against all others at once: tensors indexed by item (0, 1, ... in
        # arrival order); a loop over pairs took a CPU-second
        others = torch.arange(len(arrived))
        arrival = torch.tensor([arrived[other] for other in range(len(arrived))])
        started = torch.tensor([served.get(other, never) for other in range(len(arrived))])
        worst = 0
        for item, turn in served.items():
            aged = arrived[item] + MAX_PRIORITY - priority[item]  # it has aged enough from here
            # the others that arrived once ``item`` had aged enough
            came_after = (arrival >= aged) & (others > item)
            waiting_then = int(((started >= aged) & ~came_after & (others != item)).sum())
            passes = turn - arrived[item]
            assert passes <= MAX_PRIORITY - priority[item] + waiting_then
            assert not bool((came_after & (started < turn)).any())  # none of them went first
            worst = max(worst, passes)
        assert len(served) > 1_300
        assert worst > MAX_PRIORITY  # the run did make items wait behind others


class TestMayGo:
    def test_every_small_queue_lets_go_as_the_rule_says(self) -> None:
        """Over every queue of up to 4 items and every ready subset, the items that may go
        are those the rule names, in line; with no lead or nothing ready, the first only."""
        cases = small_queues()
        for lead in (0, 1, 3):
            for places, ready in cases:
                going = may_go(places, ready, lead)
                assert going == allowed(places, ready, lead)
                if lead == 0 or not ready:
                    assert going == [places[0].item]
        assert len(cases) == 21_834

    def test_a_ready_item_goes_ahead_by_the_lead_and_no_further(self) -> None:
        """A ready item may go before an older one until that one has aged ``lead`` turns
        more than it; never before a higher priority that is not ready."""
        for waited in range(5):
            queue: PriorityQueue[str] = PriorityQueue()
            queue.push("needs a move", 0)
            for _ in range(waited):
                queue.served()
            queue.push("ready", 0)
            expected = ["ready"] if waited < 3 else ["needs a move"]
            assert queue.going({"ready"}, 3) == expected
            assert queue.going({"ready"}, 0) == ["needs a move"]  # no lead, no pass
        queue = PriorityQueue()
        queue.push("urgent, needs a move", 2)
        queue.push("ready", 1)
        assert queue.going({"ready"}, 5) == ["urgent, needs a move"]


@st.composite
def runs(draw: st.DrawFn) -> tuple[int, list[list[tuple[int, bool]]]]:
    """A lead, and 200 turns of a queue: the items arriving before each turn, each with its
    priority and whether it is ready (its turn costs nothing), at drawn rates."""
    lead = draw(st.integers(0, 4))
    ready_share = draw(st.sampled_from((0.0, 0.5, 0.9, 1.0)))
    arrivals = draw(st.sampled_from(((0, 1, 2), (0, 1, 1, 2), (1, 1, 2, 3))))
    rng = random.Random(draw(st.integers(0, 2**32)))
    turns = [
        [
            (rng.choice((0, 0, 0, 1, 3, MAX_PRIORITY)), rng.random() < ready_share)
            for _ in range(rng.choice(arrivals))
        ]
        for _ in range(200)
    ]
    return lead, turns


@settings(max_examples=40, derandomize=True, deadline=None)
@given(runs())
def test_the_bound_holds_with_a_lead(run: tuple[int, list[list[tuple[int, bool]]]]) -> None:
    """With ready items going ahead by a lead ``L``, whichever of those that may go is
    served, no item is passed over more than ``(P + L - p) + (W - 1)`` times, and none
    arriving once it aged ``P + L - p`` goes first."""
    lead, turns = run
    pick = random.Random(0)  # which of those that may go is served: any will do
    queue: PriorityQueue[int] = PriorityQueue()
    priority: dict[int, int] = {}
    arrived: dict[int, int] = {}  # the turns served when it arrived
    served: dict[int, int] = {}  # the turn it was served in
    ready: set[int] = set()
    for arrivals in turns:
        for value, is_ready in arrivals:
            item = len(priority)
            priority[item], arrived[item] = value, queue.turns
            queue.push(item, value)
            if is_ready:
                ready.add(item)
        if len(queue):
            head = pick.choice(queue.going(ready, lead))
            queue.remove(head)
            served[head] = queue.turns
            queue.served()
    never = queue.turns + 1
    for item, turn in served.items():
        aged = arrived[item] + MAX_PRIORITY + lead - priority[item]
        came_after = {o for o in arrived if o > item and arrived[o] >= aged}
        waiting_then = [
            o for o in arrived if o != item and o not in came_after and served.get(o, never) >= aged
        ]
        assert turn - arrived[item] <= MAX_PRIORITY + lead - priority[item] + len(waiting_then)
        assert all(served.get(o, never) > turn for o in came_after)
