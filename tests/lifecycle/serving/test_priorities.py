"""Priorities in the worker's queue (design §15): higher first, FIFO within a priority,
ageing with a stated bound (``lifecycle.device.priorities``), 429 per priority."""

from __future__ import annotations

import random
import threading
from collections.abc import Callable
from concurrent.futures import Future

import httpx

from lifecycle.serving.jobs import BatchKey, Job
from lifecycle.spec.structs import PipelineSpec
from tests.lifecycle.serving.conftest import WATCHDOG_S, ServeSpec
from tests.lifecycle.serving.test_cancelling import generate, occupy_runners, release
from tests.lifecycle.test_waiting import until

SpecMaker = Callable[..., PipelineSpec]

MAX_PRIORITY = 10
KEY = BatchKey(endpoint="images", steps=1, latent_size=(4, 4))


def job(name: str, priority: int, key: BatchKey = KEY) -> Job:
    """Return a small image job of ``priority``."""
    return Job(id=name, key=key, prompts=["a fox"], tokens=16, priority=priority)


class TestOrder:
    def test_high_priority_starts_in_the_next_batch_behind_fifty_low(
        self, serve_spec: ServeSpec, t2i_spec: SpecMaker
    ) -> None:
        """50 queued low-priority jobs, then one high: it leads the very next batch."""
        served = serve_spec(t2i_spec(max_batch=2))
        batcher = served.worker.batcher
        assert batcher is not None
        slow = occupy_runners(batcher)
        lows = [batcher.submit(job(f"low-{i}", 0)) for i in range(50)]
        high = batcher.submit(job("high", MAX_PRIORITY))
        release(batcher, slow)
        done = [future.result(timeout=WATCHDOG_S) for future in [*lows, high]]
        first = done[-1]
        assert first.started_turn - first.queued_turn == 0  # no batch passed it over
        assert first.started_turn <= min(low.started_turn for low in done[:-1])
        assert [low.started_turn for low in done[:-1]] == sorted(
            low.started_turn for low in done[:-1]
        )

    def test_ageing_bound_holds_in_a_long_mixed_run(
        self, serve_spec: ServeSpec, t2i_spec: SpecMaker
    ) -> None:
        """300 jobs of random priorities and two keys arriving while batches run: none is
        passed over by more than (max_priority - p) + the jobs queued once it aged that much."""
        served = serve_spec(t2i_spec(max_batch=3, batch_window_ms=1))
        batcher = served.worker.batcher
        assert batcher is not None
        rng = random.Random(22)
        keys = [KEY, BatchKey(endpoint="images", steps=2, latent_size=(4, 4))]
        futures: list[Future[Job]] = []
        for i in range(300):
            priority = rng.choice((0, 0, 0, 0, 0, 1, 3, 5, 10))
            futures.append(batcher.submit(job(f"j{i}", priority, rng.choice(keys))))
            if rng.random() < 0.3:
                threading.Event().wait(0.002)  # let some batches start between arrivals
        jobs = [future.result(timeout=WATCHDOG_S) for future in futures]
        worst = 0
        for index, done in enumerate(jobs):
            aged = done.queued_turn + MAX_PRIORITY - done.priority

            def came_after(other: int, index: int = index, aged: int = aged) -> bool:
                return jobs[other].queued_turn >= aged and other > index

            waiting_then = sum(
                1
                for other in range(len(jobs))
                if other != index and not came_after(other) and jobs[other].started_turn >= aged
            )
            passes = done.started_turn - done.queued_turn
            assert passes <= MAX_PRIORITY - done.priority + waiting_then, done.id
            worst = max(worst, passes)
        assert worst > MAX_PRIORITY  # jobs did wait behind many others


class TestLimits:
    def test_full_queue_is_429_per_priority(
        self, serve_spec: ServeSpec, t2i_spec: SpecMaker
    ) -> None:
        """With max_queue jobs of priority 0 in flight, priority 0 gets 429; priority 1 runs."""
        served = serve_spec(t2i_spec(max_queue=2))
        batcher = served.worker.batcher
        assert batcher is not None
        slow = occupy_runners(batcher)  # two jobs of priority 0
        with served.client() as client:
            refused = generate(client, steps=1)
            accepted: list[httpx.Response] = []
            thread = threading.Thread(
                target=lambda: accepted.append(generate(served.client(), steps=1, priority=1))
            )
            thread.start()
            until(lambda: batcher.depth == 1)  # queued while priority 0 is full
            release(batcher, slow)
            thread.join(WATCHDOG_S)
        assert refused.status_code == 429
        assert "for priority 0" in refused.json()["error"]["message"]
        assert accepted[0].status_code == 200

    def test_priority_above_the_limit_is_400(
        self, serve_spec: ServeSpec, t2i_spec: SpecMaker
    ) -> None:
        """A priority above serving.max_priority is refused, naming the key."""
        served = serve_spec(t2i_spec(max_priority=3))
        with served.client() as client:
            response = generate(client, steps=1, priority=4)
            embeddings = client.post("/v1/embeddings", json={"input": "x", "priority": -1})
        assert response.status_code == 400
        assert response.json()["error"]["param"] == "priority"
        assert "serving.max_priority = 3" in response.json()["error"]["message"]
        assert embeddings.status_code == 400
        assert embeddings.json()["error"]["param"] == "priority"
