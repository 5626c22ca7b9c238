"""Set up the process groups of an admitted pipeline's layout at ``load()`` (design §6).

The one place the orchestrator touches ``torch.distributed``: it compares the layout's
world size with the launched one (a refusal, before any process-group call), joins the
process group torchrun describes in the environment when none exists yet, builds the
layout's named ``DeviceMesh`` and tells each custom-path loader how its component is
split. Nothing happens at all when every degree is 1.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from datetime import timedelta

import structlog
import torch
import torch.distributed as dist

from components.mesh import ParallelMesh
from lifecycle.device.slots import ComponentSlot
from lifecycle.refusals import Refusal, RefusalCode
from lifecycle.spec.structs import PipelineSpec

__all__ = ["setup_parallel", "world_refusals"]


def launched_world() -> int:
    """Return the processes launched: the process group's, else torchrun's ``WORLD_SIZE``."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return int(os.environ.get("WORLD_SIZE", "1"))


def world_refusals(spec: PipelineSpec) -> list[Refusal]:
    """Refuse a layout whose world size is not the launched one (the ``load`` guard)."""
    needed, launched = spec.parallel.world_size, launched_world()
    if needed == launched:
        return []
    return [
        Refusal(
            code=RefusalCode.INVALID_LAYOUT,
            component=spec.name,
            message=f"the parallel layout needs {needed} processes, but "
            f"{launched} {'was' if launched == 1 else 'were'} launched",
            hint=f"launch {needed} processes (torchrun --nproc-per-node "
            f"{needed}), or shrink [parallel] to {launched}",
        )
    ]


def setup_parallel(
    spec: PipelineSpec, slots: Mapping[str, ComponentSlot], device: torch.device
) -> ParallelMesh | None:
    """Build the layout's mesh on this rank and hand each custom-path loader its split.

    Runs in the work of the first ``load``, after its ``world_launched`` guard passed,
    so no process-group call precedes that refusal. Returns None, touching nothing,
    when the layout needs one process.
    """
    needed = spec.parallel.world_size
    if needed == 1:
        return None
    if not dist.is_initialized():
        if device.type == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(
            "nccl" if device.type == "cuda" else "gloo",
            timeout=timedelta(seconds=spec.parallel.timeout_s),
        )
    structlog.contextvars.bind_contextvars(rank=dist.get_rank())
    mesh = ParallelMesh(spec.parallel, device.type)
    for name, slot in slots.items():
        if slot.plan is not None and slot.plan.loader == "custom":
            slot.loader.parallel = mesh.for_component(
                name,
                sequence_parallel=slot.loader.sequence_parallel,
                tensor_parallel=slot.loader.tensor_parallel,
                guidance_parallel=slot.loader.guidance_parallel,
            )
    return mesh
