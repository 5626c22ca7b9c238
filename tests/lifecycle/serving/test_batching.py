"""Batching across requests (design §5.5): compatible jobs run as one packed batch."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from concurrent.futures import Future
from contextlib import contextmanager

import pytest

from lifecycle.serving.batcher import Batcher
from lifecycle.serving.jobs import OUTPUT_TOLERANCE, BatchKey, Job
from lifecycle.spec.structs import PipelineSpec
from tests.lifecycle.serving.conftest import WATCHDOG_S, Gate, ServeSpec, run_alone

PROMPTS = ("a red fox", "an astronaut riding a horse on the moon", "ramen", "a lighthouse")
UNTIL_FULL_MS = WATCHDOG_S * 1000
"""A batch window no test waits out: behind a running batch, a batch starts once
``serving.max_batch`` compatible jobs are queued, however slowly a loaded machine
submits them (a window in milliseconds would decide the batches by timing)."""


def image_job(index: int, key: BatchKey) -> Job:
    """Return image job ``index``: its own prompt, seed and image count."""
    prompts = [PROMPTS[index % len(PROMPTS)]] * (1 + index % 2)
    return Job(id=f"j{index}", key=key, prompts=prompts, tokens=16 * len(prompts), seed=index)


@contextmanager
def occupied(batcher: Batcher, gate: Gate, slow: Job | None = None) -> Iterator[Future[Job]]:
    """Hold a batch (``slow``, or one of the reference pipeline) at ``gate`` while the block
    submits the next jobs, so that they gather behind it; open the gate after.

    An idle worker would start the first of them at once, alone. ``slow`` names the
    ``gated`` backend, which the ``gated`` fixture registers.
    """
    if slow is None:
        key = BatchKey(endpoint="images", steps=1, latent_size=(8, 8), attention_backend="gated")
        slow = Job(id="slow", key=key, prompts=["slow"], tokens=64)
    future = batcher.submit(slow)
    try:
        assert gate.reached.wait(WATCHDOG_S), "the slow batch never reached its kernel"
        yield future
    finally:
        gate.opened.set()


class TestBatcher:
    def test_batched_outputs_equal_each_job_alone(
        self, serve_spec: ServeSpec, t2i_spec: Callable[..., PipelineSpec], gated: Gate
    ) -> None:
        """Six jobs queued together run as one batch; each output equals the job run alone."""
        served = serve_spec(t2i_spec(batch_window_ms=UNTIL_FULL_MS, max_batch=6))
        batcher = served.worker.batcher
        assert batcher is not None
        key = BatchKey(endpoint="images", steps=2, latent_size=(4, 4))
        with occupied(batcher, gated) as blocker:
            futures = [batcher.submit(image_job(i, key)) for i in range(6)]
        done = [future.result(timeout=WATCHDOG_S) for future in futures]
        assert {job.batch_size for job in done} == {6}
        assert done[0].batch_id == "+".join(f"j{i}" for i in range(6))
        assert blocker.result(timeout=WATCHDOG_S).batch_size == 1
        for job in done:
            assert job.output is not None
            alone = run_alone(served.worker, image_job(int(job.id[1:]), key))
            assert (job.output - alone).abs().max() <= OUTPUT_TOLERANCE

    def test_incompatible_jobs_never_share_a_batch(
        self, serve_spec: ServeSpec, t2i_spec: Callable[..., PipelineSpec], gated: Gate
    ) -> None:
        """Different steps, sizes or overrides go to different batches, each still correct."""
        # two jobs of each key: a full batch is one key's pair, or two jobs that mix keys
        served = serve_spec(t2i_spec(batch_window_ms=UNTIL_FULL_MS, max_batch=2))
        batcher = served.worker.batcher
        assert batcher is not None
        keys = [
            BatchKey(endpoint="images", steps=2, latent_size=(4, 4)),
            BatchKey(endpoint="images", steps=3, latent_size=(4, 4)),
            BatchKey(endpoint="images", steps=2, latent_size=(2, 4)),
            BatchKey(endpoint="images", steps=2, latent_size=(4, 4), attention_backend="reference"),
        ]
        jobs = [image_job(i, keys[i % len(keys)]) for i in range(8)]
        with occupied(batcher, gated):
            futures = [batcher.submit(job) for job in jobs]
        done = [f.result(timeout=WATCHDOG_S) for f in futures]
        batches: dict[str, set[BatchKey]] = {}
        for job in done:
            batches.setdefault(job.batch_id, set()).add(job.key)
        assert all(len(found) == 1 for found in batches.values()), batches
        assert done[0].batch_id == "j0+j4"  # the first pair ran together
        for job in done:
            assert job.output is not None
            alone = run_alone(served.worker, image_job(int(job.id[1:]), job.key))
            assert (job.output - alone).abs().max() <= OUTPUT_TOLERANCE

    @pytest.mark.parametrize(
        ("settings", "jobs"),
        [
            # the window is never waited out: each batch starts once two jobs are queued
            ({"max_batch": 2, "batch_window_ms": UNTIL_FULL_MS}, 4),
            # three queued jobs start a batch, of which 32 tokens hold two; the last job
            # waits out the window alone
            ({"max_batch_tokens": 32, "max_batch": 3, "batch_window_ms": 100}, 3),
        ],
        ids=["max_batch", "max_batch_tokens"],
    )
    def test_batches_stop_at_the_limits(
        self,
        serve_spec: ServeSpec,
        t2i_spec: Callable[..., PipelineSpec],
        settings: dict[str, float],
        jobs: int,
        gated: Gate,
    ) -> None:
        """No batch holds more than serving.max_batch jobs or max_batch_tokens tokens."""
        served = serve_spec(t2i_spec(**settings))
        batcher = served.worker.batcher
        assert batcher is not None
        key = BatchKey(endpoint="images", steps=1, latent_size=(4, 4))
        queued = [image_job(2 * i, key) for i in range(jobs)]  # one image (16 tokens) each
        with occupied(batcher, gated):
            futures = [batcher.submit(job) for job in queued]
        done = [f.result(timeout=WATCHDOG_S) for f in futures]
        assert max(job.batch_size for job in done) == 2
        assert done[0].batch_id == "j0+j2"


class TestFaults:
    def test_a_batch_that_fails_before_it_runs_frees_its_runner(
        self, serve_spec: ServeSpec, t2i_spec: Callable[..., PipelineSpec]
    ) -> None:
        """An observer that raises as a batch starts fails that batch's jobs; later ones run."""
        served = serve_spec(t2i_spec())
        worker_batcher = served.worker.batcher
        assert worker_batcher is not None
        sizes: list[int] = []

        def observer(size: int) -> None:
            sizes.append(size)
            if len(sizes) == 1:
                raise RuntimeError("the batch observer broke")

        batcher = Batcher(
            served.worker.orchestrator, worker_batcher.settings, worker_batcher.shapes, observer
        )
        key = BatchKey(endpoint="images", steps=1, latent_size=(4, 4))
        with pytest.raises(RuntimeError, match="the batch observer broke"):
            batcher.submit(image_job(0, key)).result(timeout=WATCHDOG_S)
        done = [batcher.submit(image_job(i, key)).result(timeout=WATCHDOG_S) for i in (1, 2)]
        assert all(job.output is not None for job in done)
        assert batcher.drain(WATCHDOG_S)  # nothing in flight was left behind
        assert sizes == [1, 1, 1]
