"""One pipeline a worker serves: its orchestrator, its queue and the gate in front of it."""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path

from lifecycle.machines.tables import PipelineState
from lifecycle.orchestrator import Orchestrator
from lifecycle.serving.batcher import Batcher
from lifecycle.serving.gate import Gate
from lifecycle.serving.jobs import Job, Shapes
from lifecycle.spec.structs import PipelineSpec, ServingConfig

__all__ = ["ServedPipeline"]


@dataclass
class ServedPipeline:
    """A loaded pipeline behind the worker's endpoints.

    Attributes:
        orchestrator: the loaded pipeline.
        batcher: its queue.
        shapes: what it produces (read off its warm-up).
        path: the spec it was read from (None: given as a spec), re-read on reload.
        gate: where its requests wait while it sleeps or is being replaced.
    """

    orchestrator: Orchestrator
    batcher: Batcher
    shapes: Shapes
    path: Path | None = None
    gate: Gate = field(default_factory=Gate)

    @property
    def name(self) -> str:
        """Return the pipeline's name (the OpenAI ``model``)."""
        return self.orchestrator.spec.name

    @property
    def spec(self) -> PipelineSpec:
        """Return the pipeline's spec."""
        return self.orchestrator.spec

    @property
    def settings(self) -> ServingConfig:
        """Return the pipeline's ``[serving]`` table."""
        return self.orchestrator.spec.serving

    @property
    def state(self) -> PipelineState:
        """Return where the pipeline stands (serving, sleeping, draining, released)."""
        return self.orchestrator.pipeline_state

    def submit(self, job: Job) -> Future[Job]:
        """Queue ``job`` (see ``Batcher.submit``)."""
        return self.batcher.submit(job)
