"""What the status page shows, read off the worker as one typed value.

A ``StatusSnapshot`` is the whole worker at one moment: its phase, its device
budget with the bytes every pipeline holds together and those sharing saves, and
per pipeline its own state, its components (state, users, the pipelines sharing
each, residency, bytes), the requests waiting for memory, the queue and the running
batches, and the residency timeline of its last moves. The event stream sends one
whenever something changed, after the typed events that changed it, so the page
always ends on what the worker holds now.

A pipeline's components are read together under the device's lock, which every
move holds, so their bytes never add up to more than the budget allows (read one by
one, an eviction and the onload it made room for could both show). With them, under
the same lock, it reads the board's ``seq``: the stream's last event they show. The
snapshot is read after events that may still wait in a client's buffer; the page
skips those (at or below the ``seq``), which would otherwise replay an older move on
a newer state (an onload beside the component that had evicted it). The batcher's
view is read under its own lock; a snapshot is at worst a moment old, and the next
one follows the next event.
"""

from __future__ import annotations

import time

import msgspec

from components import ResidencyMode
from components.compile import CompileMode
from components.quantize import Quantization
from lifecycle.orchestrator import Orchestrator
from lifecycle.pictures.gantt import resident_intervals
from lifecycle.serving.batcher import Batcher
from lifecycle.serving.board import StatusBoard
from lifecycle.serving.worker import Phase, Worker

__all__ = ["worker_status"]


class ComponentStatus(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """One component as the page shows it.

    Attributes:
        name: the component.
        kind: the kind that builds it.
        state: its lifecycle state (lower-case value).
        users: the open requests using it now.
        shared_with: the other pipelines holding it (one component, held once).
        residency: its residency mode.
        target: where its weights go when offloaded; None for a resident component.
        footprint: the bytes it takes on the device while resident (quantized weights as
            their data and scales).
        resident_bytes: the bytes it holds on the device now.
        compile: how torch.compile compiles it (design §17).
        quantization: how torchao holds its linear weights (design §17).
    """

    name: str
    kind: str
    state: str
    users: tuple[str, ...]
    shared_with: tuple[str, ...]
    residency: ResidencyMode
    target: str | None
    footprint: int
    resident_bytes: int
    compile: CompileMode = "off"
    quantization: Quantization = "off"


class WaitingRequest(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """A request waiting for memory: what it waits to enter and to hold.

    Attributes:
        request_id: the orchestrator request (a batch's id).
        stage: the stage it waits to enter.
        components: the components that stage uses.
    """

    request_id: str
    stage: str
    components: tuple[str, ...]


class QueuedRequest(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """An HTTP request waiting in the queue for a batch.

    Attributes:
        id: its request id (``x-request-id``).
        endpoint: embeddings, images or videos.
        items: its prompts (images or embeddings asked for).
        queued_s: how long it has waited.
        priority: its priority (higher first, with ageing).
    """

    id: str
    endpoint: str
    items: int
    queued_s: float
    priority: int


class RunningBatch(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """A batch running as one orchestrator request.

    Attributes:
        id: the batch's id (its requests' ids joined by ``+``), the ``request_id`` of
            what it moves.
        request_ids: the HTTP requests in it.
        endpoint: embeddings, images or videos.
        stage: the stage whose components it holds now; None between stages.
        step: the denoising steps it has done in its stage.
        steps: the denoising steps it runs.
        skipped: the image steps its step cache skipped so far (design §17).
    """

    id: str
    request_ids: tuple[str, ...]
    endpoint: str
    stage: str | None
    steps: int
    step: int
    skipped: int = 0


class ResidentInterval(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """One bar of the residency timeline (the gantt ``run --timeline`` writes).

    Attributes:
        component: the component that was resident.
        start: seconds since the pipeline started, when it went resident.
        stop: when it left (the last move's time, for one still resident).
        request_id: the request its offload happened for, if any.
        prefetched: its onload came ahead of its use, for the next request.
    """

    component: str
    start: float
    stop: float
    request_id: str | None
    prefetched: bool = False


class PipelineStatus(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """One served pipeline as the page shows it.

    Attributes:
        name: the pipeline (the OpenAI ``model``).
        seq: the stream's last event its components show: the pipeline's events at or
            below it are already in them.
        phase: where its worker stands (starting, ready, draining, failed).
        state: where the pipeline stands (serving, sleeping, draining, released).
        gate: ``open``, or why its requests wait before its queue (sleeping, swapping,
            removed).
        budget: the worker's device budget in bytes, which every pipeline shares; None
            when unlimited.
        resident_bytes: the bytes its components hold on the device now (a shared
            component counts in each pipeline holding it).
        stages: the stages in timeline order.
        components: its components, in spec order.
        waiting: the requests waiting for memory, first in line first.
        queued: the requests waiting for a batch, oldest first.
        running: the batches running now.
        timeline: the resident intervals of its last moves, per component in spec order.
    """

    name: str
    seq: int
    phase: str
    state: str
    gate: str
    budget: int | None
    resident_bytes: int
    stages: tuple[str, ...]
    components: tuple[ComponentStatus, ...]
    waiting: tuple[WaitingRequest, ...]
    queued: tuple[QueuedRequest, ...]
    running: tuple[RunningBatch, ...]
    timeline: tuple[ResidentInterval, ...]


class StatusSnapshot(
    msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True, tag="status.snapshot"
):
    """The worker and every pipeline it serves at one moment (the stream's
    ``status.snapshot``).

    Attributes:
        phase: where the worker stands (starting, ready, draining, failed).
        budget: its device budget in bytes, for every pipeline together; None when
            unlimited.
        resident_bytes: the bytes every pipeline holds on the device now, a shared
            component counted once.
        shared_bytes_saved: the bytes sharing equal components saves against holding
            each pipeline's own.
        pipelines: each pipeline's status.
    """

    phase: str
    budget: int | None
    resident_bytes: int
    shared_bytes_saved: int
    pipelines: tuple[PipelineStatus, ...]


def pipeline_status(
    orchestrator: Orchestrator,
    batcher: Batcher | None,
    phase: str,
    gate: str,
    board: StatusBoard,
) -> PipelineStatus:
    """Return one pipeline's status now.

    Args:
        orchestrator: the pipeline.
        batcher: its queue, None before it is ready.
        phase: its worker's phase.
        gate: ``open``, or why its requests wait at its gate.
        board: the worker's status board: the stream's order, and the pipeline's last
            moves (the timeline's bars).
    """
    spec = orchestrator.spec
    shared = orchestrator.shared
    with shared.lock:  # one moment for all: an eviction and its onload are one trigger
        views = [orchestrator.component(name) for name in spec.components]
        seq = board.seq  # every move and transition is published under this lock
    components = tuple(
        ComponentStatus(
            name=view.name,
            kind=view.spec.kind,
            state=view.state.value,
            users=view.in_use_by,
            shared_with=tuple(
                sorted({shared.name_of(k) for k in view.users if k != orchestrator.key})
            ),
            residency=view.spec.residency_mode,
            target=None
            if view.spec.residency_mode is ResidencyMode.RESIDENT
            else spec.memory.offload_target,
            footprint=view.footprint,
            resident_bytes=view.resident_bytes,
            compile=view.spec.compile_mode,
            quantization=view.spec.quantization_mode,
        )
        for view in views
    )
    waiting = tuple(  # the device's one line holds every pipeline's waiters: its own
        WaitingRequest(request_id=rid, stage=stage.name, components=stage.uses)
        for rid, stage in orchestrator.waiter.waiting()
        if shared.pipeline_of(rid) == orchestrator.key
    )
    queued: tuple[QueuedRequest, ...] = ()
    running: tuple[RunningBatch, ...] = ()
    if batcher is not None:
        view = batcher.view()
        now = time.monotonic()
        queued = tuple(
            QueuedRequest(
                id=job.id,
                endpoint=job.key.endpoint,
                items=len(job.prompts),
                queued_s=round(now - arrived, 3),
                priority=job.priority,
            )
            for job, arrived in view.queued
        )
        running = tuple(
            RunningBatch(
                id=batch_id,
                request_ids=tuple(job.id for job in jobs),
                endpoint=jobs[0].key.endpoint,
                stage=_stage_held(
                    orchestrator, {c.name for c in components if batch_id in c.users}
                ),
                steps=jobs[0].key.steps,
                step=step,
                skipped=skipped,
            )
            for batch_id, jobs, step, skipped in view.running
        )
    intervals = resident_intervals(list(spec.components), board.recent_moves(spec.name))
    timeline = tuple(
        ResidentInterval(
            component=name,
            start=interval.start,
            stop=interval.stop,
            request_id=interval.request_id,
            prefetched=interval.prefetched,
        )
        for name, found in intervals.items()
        for interval in found
    )
    return PipelineStatus(
        name=spec.name,
        seq=seq,
        phase=phase,
        state=orchestrator.pipeline_state.value,
        gate=gate,
        budget=shared.budget.limit,
        resident_bytes=sum(c.resident_bytes for c in components),
        stages=tuple(stage.name for stage in spec.stages),
        components=components,
        waiting=waiting,
        queued=queued,
        running=running,
        timeline=timeline,
    )


def _stage_held(orchestrator: Orchestrator, held: set[str]) -> str | None:
    """Return the stage whose components a request holds: the one it is in (a stage with
    step windows holds one windowed use at a time)."""
    if not held:
        return None
    for stage in orchestrator.spec.stages:
        if any(set(together) == held for together in stage.held_together()):
            return stage.name
    return None


def worker_status(worker: Worker) -> StatusSnapshot:
    """Return the worker and every pipeline it serves (while starting: those it loads), now."""
    phase = worker.phase.value
    if worker.phase in (Phase.STARTING, Phase.FAILED):
        pipelines = tuple(
            pipeline_status(o, None, phase, "open", worker.board) for o in worker.orchestrators
        )
    else:
        pipelines = tuple(
            pipeline_status(
                served.orchestrator,
                served.batcher,
                phase,
                served.gate.closed_for or "open",
                worker.board,
            )
            for served in worker.served()
        )
    shared = worker.shared
    return StatusSnapshot(
        phase=phase,
        budget=shared.budget.limit,
        resident_bytes=shared.resident_bytes(),
        shared_bytes_saved=shared.saved_bytes(),
        pipelines=pipelines,
    )
