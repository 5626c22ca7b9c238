"""Run the real DiTs (folder kinds, custom path) under a layout, on one rank of a gloo group.

A case is a pipeline folder's transformer and a ``[parallel]`` table. Layouts the
lifecycle loads (sequence parallel) go through ``Orchestrator.load()``; tensor parallel
and FSDP, whose ``DTensor`` weights the offload stores cannot hold yet, build the same
loader, mesh and split outside it (as ``layout_worker`` does for the tiny DiT). Every
case runs the same seeded mixed-size groups, or the prompt-length sweep
(``tests.components.dit_inputs``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import msgspec
import torch

from attention import ComponentRequests, Platform, arm_layers, component_attention_scope
from components import ParallelLayout, registry
from components.accounting import module_bytes
from components.cache import CacheSettings, RowCache, StepCache
from components.kinds.dit_loader import DitLoader
from components.mesh import ParallelMesh
from lifecycle import Orchestrator
from lifecycle.spec.reading import decode_spec
from tests.components.dit_inputs import KINDS, mixed_groups, sweep_forwards
from tests.parallel.layout_worker import Outputs, Ran

SPEC = """
name = "dit"
device = "cpu"
[components.transformer]
kind = "{kind}"
options = {{ path = "{path}", packed_sequences = {packed} }}
[parallel]
timeout_s = 30
{layout}
"""


class DitCase(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """One DiT under one layout.

    Attributes:
        family: ``pixart``, ``flux``, ``sd3``, ``qwen-image``, ``z-image`` or ``wan`` (the
            folder's pipeline family).
        folder: the pipeline folder.
        layout: the lines of the ``[parallel]`` table.
        direct: build through the loader outside the lifecycle (DTensor weights).
        packed: the DiT's ``packed_sequences`` option.
        sweep: run the prompt-length sweep (many forwards) instead of the mixed groups.
        cache: run the mixed groups over ``CACHE_STEPS`` steps under a step cache of this
            method (``cached_steps``) instead, the folder's time embedding smoothed.
    """

    family: str
    folder: str
    layout: str = ""
    direct: bool = False
    packed: bool = True
    sweep: bool = False
    cache: str = ""

    def spec(self, *, split: bool = True) -> str:
        """Return the one-DiT spec (without its layout unless ``split``)."""
        return SPEC.format(
            kind=KINDS[self.family],
            path=f"{self.folder}/transformer",
            packed=str(self.packed).lower(),
            layout=self.layout if split else "",
        )


def run_dit_case(case: DitCase) -> Ran:
    """Run ``case`` on this rank: each group's output, and the weight bytes held here."""
    ran, _ = _run(case, split=True)
    return ran


def run_dit_alone(case: DitCase) -> tuple[Ran, int]:
    """Run ``case``'s DiT in this one process, unsplit; also return its blocks' bytes."""
    return _run(case, split=False)


def _run(case: DitCase, *, split: bool) -> tuple[Ran, int]:
    spec = decode_spec(case.spec(split=split))
    options = spec.components["transformer"].options
    loader = registry.get(KINDS[case.family]).from_options(options)
    assert isinstance(loader, DitLoader)
    if case.sweep:
        forwards = sweep_forwards(case.family, loader.config)
    else:
        forwards = [mixed_groups(case.family, loader.config)]
    if split and case.direct:
        return _measured(loader, _built_outside(loader, spec.parallel), forwards)
    with Orchestrator(spec) as orchestrator:
        orchestrator.load()
        module = orchestrator.module("transformer")
        if case.cache:
            outputs, patterns = cached_steps(module, case.family, loader.config, case.cache)
            return Ran(outputs, module_bytes(module), {}, patterns), 0
        return _measured(loader, module, forwards)


CACHE_STEPS = 10


def cached_steps(
    module: torch.nn.Module, family: str, config: Mapping[str, Any], method: str
) -> tuple[Outputs, tuple[str, ...]]:
    """Run the mixed groups over ``CACHE_STEPS`` steps, their timesteps falling by half, each
    request under its own cache of ``method``; every step's outputs and each row's pattern."""
    settings = CacheSettings(method=method)  # type: ignore[arg-type]
    groups = mixed_groups(family, config)
    rows = [RowCache(settings, CACHE_STEPS) for group in groups for _ in group.timestep]
    outputs: Outputs = []
    for step in range(CACHE_STEPS):
        now = [g._replace(timestep=g.timestep * (1 - step / (2 * CACHE_STEPS))) for g in groups]
        with torch.inference_mode():
            outputs += module(now, StepCache(step, CACHE_STEPS, [(row, 0) for row in rows]))
    return outputs, tuple(row.pattern for row in rows)


def _measured(
    loader: DitLoader, module: torch.nn.Module, forwards: list[list[object]]
) -> tuple[Ran, int]:
    blocks = loader.blocks(module) or []
    outputs = [out for groups in forwards for out in _outputs(module, groups)]
    ran = Ran(outputs, module_bytes(module), {})
    return ran, sum(module_bytes(block) for block in blocks)


def _built_outside(loader: DitLoader, layout: ParallelLayout) -> torch.nn.Module:
    mesh = ParallelMesh(layout, "cpu")
    loader.parallel = mesh.for_component(
        "transformer",
        sequence_parallel=loader.sequence_parallel,
        tensor_parallel=loader.tensor_parallel,
    )
    requests = ComponentRequests(
        component="transformer", ring=layout.ring_degree > 1 and loader.sequence_parallel
    )
    with component_attention_scope(requests, platform=Platform("cpu")):
        module = loader.build("custom")
    arm_layers(module)
    return module


def _outputs(module: torch.nn.Module, groups: list[object]) -> Outputs:
    with torch.inference_mode():
        outputs: Outputs = module(groups)
    return outputs
