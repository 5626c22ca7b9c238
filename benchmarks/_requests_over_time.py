"""Requests over time (issue 22), part of ``python -m benchmarks serving``.

- Streaming: the p50 latency of one image request (tiny_t2i, 8 steps, 32x32) over
  HTTP, answered as JSON, streamed with a progress event per step, and streamed with
  3 previews; one client, sequential, modes alternating in rounds (order reversed
  every round), medians over rounds.
- Previews: what one preview costs (``lifecycle.serving.preview.preview_png`` on a
  32x32 image's latents) against one denoising step of that image, and how far the
  preview of the final latents is from the decoded image (mean absolute difference
  of pixels in [-1, 1]) against a flat image of the mean colour.
- Priorities: the latency of one high-priority job submitted to the worker's queue
  (no HTTP) right behind 160 queued low-priority jobs (10 batches of 16), against the
  same job on an empty queue, and against a low-priority job behind the same 160
  (FIFO); the cases alternate, their order reversed every round.
"""

from __future__ import annotations

import itertools
import statistics
import time
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path

import httpx
import torch

from components.batch import Batch, StepDone
from lifecycle.orchestrator import Orchestrator
from lifecycle.serving.jobs import BatchKey, Job
from lifecycle.serving.metrics import ServingMetrics
from lifecycle.serving.preview import preview_image, preview_png
from lifecycle.serving.worker import Worker

STEPS = 8
SIZE = "32x32"
ROUNDS = 5
PER_ROUND = 10
QUEUED = 160
HIGH = 10


def streaming(url: str) -> None:
    """Print the latency of plain, streamed and previewed image requests over HTTP."""
    body = {"prompt": "a red fox", "steps": STEPS, "size": SIZE, "seed": 1}
    modes: dict[str, dict[str, object]] = {
        "JSON answer": body,
        "streamed, a progress event per step": {**body, "stream": True},
        "streamed, 3 previews": {**body, "stream": True, "partial_images": 3},
    }
    medians: dict[str, list[float]] = {mode: [] for mode in modes}
    with httpx.Client(base_url=url, timeout=600) as client:
        for request in modes.values():  # warm each path once
            client.post("/v1/images/generations", json=request).raise_for_status()
        for round_ in range(ROUNDS):
            order = list(modes) if round_ % 2 == 0 else list(modes)[::-1]
            for mode in order:
                seconds = []
                for _ in range(PER_ROUND):
                    started = time.perf_counter()
                    answer = client.post("/v1/images/generations", json=modes[mode])
                    answer.raise_for_status()  # the whole body, to the last event
                    seconds.append(time.perf_counter() - started)
                medians[mode].append(statistics.median(seconds))
    plain = statistics.median(medians["JSON answer"])
    print(f"\n| image request ({STEPS} steps, {SIZE}), one client | p50 ms | vs JSON |")
    print("|---|---:|---:|")
    for mode, values in medians.items():
        p50 = statistics.median(values)
        print(f"| {mode} | {p50 * 1e3:.1f} | {p50 / plain:.2f}x |")


def previews(spec: Path) -> None:
    """Print the cost of one preview against one denoising step, and its fidelity.

    Each step makes its preview in the step hook, as a streamed request does, and the
    two are timed apart at the same moment: a shared machine's drift hits both alike.
    """
    worker = Worker([Orchestrator.from_file(spec)], ServingMetrics(lambda: 0, lambda: 0))
    worker.start()  # fits the preview map
    mapping, scale = worker.shapes.preview, worker.shapes.image_scale
    marks: list[tuple[float, float]] = []  # (preview seconds, when the hook ended)

    def hook(done: StepDone) -> None:
        began = time.perf_counter()
        preview_png(done.latents[0], mapping, (8, 8), scale)
        ended = time.perf_counter()
        marks.append((ended - began, ended))

    previews: list[float] = []
    steps: list[float] = []
    for _ in range(ROUNDS):
        generator = torch.Generator().manual_seed(1)
        batch = Batch(
            generator=generator,
            steps=STEPS,
            prompts=["a red fox"],
            latents=[torch.randn(64, 4, generator=generator)],
            latent_size=(8, 8),
            on_step=hook,
        )
        marks.clear()
        with worker.orchestrator.request() as request:
            request.run_all(batch)
        previews += [seconds for seconds, _ in marks]
        # between two hooks' ends: one step, then that step's preview
        steps += [b[1] - a[1] - b[0] for a, b in itertools.pairwise(marks)]
    preview, step = statistics.median(previews), statistics.median(steps)
    assert batch.images is not None
    assert batch.latents is not None
    image = batch.images[0]
    guess = preview_image(batch.latents[0], mapping, (8, 8), scale)
    flat = image.mean(dim=(1, 2), keepdim=True).expand_as(image)
    print("\n| preview (32x32 image, linear latent-to-RGB map) | value |\n|---|---:|")
    print(f"| one preview (map, upsample, PNG, in the step hook) | {preview * 1e3:.2f} ms |")
    print(f"| one denoising step of that image | {step * 1e3:.2f} ms |")
    print(f"| preview / step | {preview / step:.1%} |")
    print(
        f"| preview vs decoded image, mean abs pixel error | {(guess - image).abs().mean():.3f} |"
    )
    print(f"| flat mean colour vs decoded image (oracle) | {(flat - image).abs().mean():.3f} |")
    worker.drain()


def priorities(spec: Path) -> None:
    """Print the latency of a high-priority job behind a full low-priority queue."""
    worker = Worker([Orchestrator.from_file(spec)], ServingMetrics(lambda: 0, lambda: 0))
    worker.start()
    key = BatchKey(endpoint="images", steps=STEPS, latent_size=(8, 8))
    count = iter(range(10**9))

    def job(priority: int) -> Job:
        return Job(id=f"b{next(count)}", key=key, prompts=["a fox"], tokens=64, priority=priority)

    def latency(priority: int, behind: int) -> float:
        lows: list[Future[Job]] = [worker.submit(job(0)) for _ in range(behind)]
        started = time.perf_counter()
        worker.submit(job(priority)).result()
        seconds = time.perf_counter() - started
        for future in lows:
            future.result()
        return seconds

    latency(HIGH, 0)  # warm up
    cases: dict[str, Callable[[], float]] = {
        "high priority, empty queue": lambda: latency(HIGH, 0),
        f"high priority, behind {QUEUED} low-priority jobs": lambda: latency(HIGH, QUEUED),
        f"low priority, behind {QUEUED} low-priority jobs (FIFO)": lambda: latency(0, QUEUED),
    }
    timings: dict[str, list[float]] = {name: [] for name in cases}
    for round_ in range(ROUNDS):  # cases alternate, order reversed every round: drift hits all
        for name in list(cases) if round_ % 2 == 0 else list(cases)[::-1]:
            timings[name].append(cases[name]())
    results = {name: statistics.median(values) for name, values in timings.items()}
    empty = results["high priority, empty queue"]
    print(
        f"\n| one job ({STEPS} steps, 32x32), worker queue without HTTP | latency ms | vs empty |"
    )
    print("|---|---:|---:|")
    for name, seconds in results.items():
        print(f"| {name} | {seconds * 1e3:.1f} | {seconds / empty:.2f}x |")
    worker.drain()
