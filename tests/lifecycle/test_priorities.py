"""The order of waiting requests (``lifecycle.device.priorities``): priority, FIFO, ageing."""

from __future__ import annotations

import random

import torch

from lifecycle.device.priorities import PriorityQueue

MAX_PRIORITY = 5


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
