"""The main job: run requests of a pipeline through the orchestrator and sum them up."""

from __future__ import annotations

import time
from collections.abc import Callable

import msgspec
import torch

from components.batch import Batch
from lifecycle.orchestrator import Orchestrator
from lifecycle.residency import Move


class ComponentReport(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """What one component did during a run.

    Attributes:
        state: its state at the end.
        backends: each attention site's backend, with the fallback reason if any.
        onloads: moves onto the device.
        offloads: moves off it.
        bytes_moved: bytes moved either way.
        move_seconds: time spent moving.
    """

    state: str
    backends: tuple[str, ...]
    onloads: int
    offloads: int
    bytes_moved: int
    move_seconds: float


class RunReport(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """A run of ``lifecycle run``.

    Attributes:
        pipeline: the pipeline's name.
        requests: how many requests ran.
        steps: denoising steps per request.
        request_ms: each request's wall time.
        components: what each component did.
    """

    pipeline: str
    requests: int
    steps: int
    request_ms: tuple[float, ...]
    components: dict[str, ComponentReport]


def run_requests(
    orchestrator: Orchestrator,
    moves: list[Move],
    *,
    requests: int | range,
    steps: int,
    guidance_scale: float | None = None,
    on_request: Callable[[int], None] | None = None,
) -> RunReport:
    """Run ``requests`` requests (a count, or the indices to run) through every stage.

    ``moves`` is the list the orchestrator's observer appends to; each request
    starts from seeded inputs (seed = its index).

    Raises:
        NotImplementedError: a component's kind does not say how it runs.
        TransitionRefused: a stage could not onload its components.
    """
    durations = []
    indices = range(requests) if isinstance(requests, int) else requests
    for index in indices:
        started = time.perf_counter()
        batch = Batch(
            generator=torch.Generator().manual_seed(index),
            steps=steps,
            guidance_scale=guidance_scale,
        )
        with orchestrator.request(f"r{index + 1}") as request:
            for stage in orchestrator.spec.stages:
                request.run(stage.name, batch)
        durations.append(round((time.perf_counter() - started) * 1e3, 3))
        if on_request is not None:
            on_request(len(durations))
    snapshot = orchestrator.snapshot()
    return RunReport(
        pipeline=orchestrator.spec.name,
        requests=len(indices),
        steps=steps,
        request_ms=tuple(durations),
        components={
            name: ComponentReport(
                state=component.state.value,
                backends=tuple(
                    f"{s.site}={s.backend}" + (f" ({s.reason})" if s.reason else "")
                    for s in component.attention
                ),
                onloads=sum(m.direction == "onload" for m in moves if m.component == name),
                offloads=sum(m.direction == "offload" for m in moves if m.component == name),
                bytes_moved=sum(m.bytes for m in moves if m.component == name),
                move_seconds=round(sum(m.seconds for m in moves if m.component == name), 6),
            )
            for name, component in snapshot.components.items()
        },
    )
