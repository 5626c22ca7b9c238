"""The spawn target of the layout parity tests: run many layouts on one process group.

Each rank joins the gloo group through a shared file, with the rank variables torchrun
would set, then runs every case: a spec loaded through ``Orchestrator.load()`` (which
builds the mesh and splits the components) and driven on seeded inputs, or, for layouts
whose ``DTensor`` weights the offload stores cannot hold yet (tensor parallel, FSDP), the
same loader, mesh and split built outside the lifecycle. Rank 0 saves each case's
outputs; every rank writes the bytes it sent and any failure, for the parent to assert on.
"""

from __future__ import annotations

import traceback
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, NamedTuple

import msgspec
import torch
from torch import nn
from torch.distributed import distributed_c10d

from attention import ComponentRequests, Platform, arm_layers, component_attention_scope
from attention.distributed import count_traffic
from components import registry
from components.accounting import module_bytes
from components.batch import Batch
from components.kinds.tiny_dit import TinyDitOptions, example_inputs
from components.layout import ParallelLayout
from components.mesh import ParallelMesh
from lifecycle import Orchestrator
from lifecycle.events import Move
from lifecycle.spec.reading import decode_spec
from lifecycle.spec.structs import PipelineSpec
from tests.ranks import joined

SEED = 20261130
REQUESTS = 4  # 6 + 11 + 16 + 6 = 39 tokens: 2 or 4 shards cut request 2 (and 1) apart

Outputs = list[torch.Tensor]


class Sent(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """What one rank did in one case.

    Attributes:
        sent: the bytes its distributed attention sent, by collective.
        held_bytes: the bytes of the compared component's weights it holds.
        moved: the bytes of each weight move the lifecycle made, by component
            (cases that run requests).
        patterns: each row's step cache decisions (``RowCache.pattern``), for cases
            whose DiT runs a cache.
        groups: the process groups this rank holds once the case ran.
    """

    sent: dict[str, int]
    held_bytes: int
    moved: dict[str, list[int]] = msgspec.field(default_factory=dict)
    patterns: list[str] = msgspec.field(default_factory=list)
    groups: int = 0


class Ran(NamedTuple):
    """What running a case here gave: the compared outputs, weights held, moves made, and
    each row's step cache decisions."""

    outputs: Outputs
    held_bytes: int
    moved: dict[str, list[int]]
    patterns: tuple[str, ...] = ()


CaseRunner = Callable[[Any], Ran]
"""Runs one case on this rank (a ``Case``, or another family's case type)."""


class Case(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """One layout to run.

    Attributes:
        spec: the pipeline spec (TOML).
        component: the component whose outputs are compared.
        direct: build it through its loader outside the lifecycle (DTensor weights).
        guidance: run the spec's ``denoise`` stage on text embeddings with this
            classifier-free guidance scale, and compare the latents it leaves.
        steps: the denoising steps of that stage.
        requests: run this many seeded requests through every stage of the spec, as
            ``lifecycle run`` does, and compare their images.
    """

    spec: str
    component: str = "transformer"
    direct: bool = False
    guidance: float | None = None
    steps: int = 3
    requests: int = 0


def run_component(loader_module: nn.Module, kind: str, options: dict[str, object]) -> Outputs:
    """Run a built component on seeded inputs: the DiT's example requests, else ``run``."""
    if kind == "tiny_dit":
        inputs = example_inputs(
            TinyDitOptions(**options),  # type: ignore[arg-type]
            REQUESTS,
            torch.Generator().manual_seed(SEED),
        )
        outputs: Outputs = loader_module(*inputs)
        return outputs
    loader = registry.get(kind).from_options(options)
    batch = Batch(generator=torch.Generator().manual_seed(SEED), size=2)
    loader.run(loader_module, batch)
    produced = [batch.images] if batch.images is not None else batch.context
    assert produced is not None
    return [t for t in produced if t is not None]


def run_requests(spec: PipelineSpec, requests: int, component: str) -> Ran:
    """Run ``requests`` seeded requests through every stage, recording each weight move."""
    moved: dict[str, list[int]] = {name: [] for name in spec.components}
    images: Outputs = []

    def record(event: object) -> None:
        # the observer sees every event; transitions carry no bytes
        if isinstance(event, Move):
            moved[event.component].append(event.bytes)

    with Orchestrator(spec, observer=record) as orchestrator:
        orchestrator.load()
        for index in range(requests):
            batch = Batch(generator=torch.Generator().manual_seed(SEED + index), steps=2)
            with orchestrator.request() as request:
                for stage in spec.stages:
                    request.run(stage.name, batch)
            assert batch.images is not None
            images.append(batch.images)
        return Ran(images, module_bytes(orchestrator.module(component)), moved)


def run_case(case: Case, spec: PipelineSpec | None = None) -> Ran:
    """Run ``case`` (or its ``spec`` as given) here."""
    spec = spec or decode_spec(case.spec)
    component = spec.components[case.component]
    if case.requests:
        return run_requests(spec, case.requests, case.component)
    if case.guidance is not None:
        generator = torch.Generator().manual_seed(SEED)
        batch = Batch(generator=generator, size=3, steps=case.steps, guidance_scale=case.guidance)
        batch.context = [torch.randn(n, 32, generator=generator) for n in (2, 5, 3)]
        with Orchestrator(spec) as orchestrator:
            orchestrator.load()
            with orchestrator.request() as request:
                request.run("denoise", batch)
            assert batch.latents is not None
            patterns = tuple(row.pattern for row in batch.cache_rows or () if row is not None)
            held = module_bytes(orchestrator.module(case.component))
            return Ran(batch.latents, held, {}, patterns)
    if not case.direct:
        with Orchestrator(spec) as orchestrator:
            orchestrator.load()
            built = orchestrator.module(case.component)
            outputs = run_component(built, component.kind, component.options)
            return Ran(outputs, module_bytes(built), {})
    loader = registry.get(component.kind).from_options(component.options)
    mesh = ParallelMesh(spec.parallel, "cpu")
    loader.parallel = mesh.for_component(
        case.component,
        sequence_parallel=loader.sequence_parallel,
        tensor_parallel=loader.tensor_parallel,
    )
    with component_attention_scope(
        ComponentRequests(
            component=case.component,
            ring=spec.parallel.ring_degree > 1 and loader.sequence_parallel,
            allow_global_fallback=loader.allows_global_fallback,
        ),
        platform=Platform("cpu"),
    ):
        module = loader.build("custom")
    arm_layers(module)
    return Ran(run_component(module, component.kind, component.options), module_bytes(module), {})


def run_cases(
    rank: int,
    world: int,
    init_file: str,
    cases: Mapping[str, Any],
    out_dir: str,
    runner: CaseRunner = run_case,
) -> None:
    """Run every case with ``runner`` as rank ``rank`` of ``world``; write outputs, traffic
    and failures."""
    out = Path(out_dir)
    with joined(rank, world, init_file):
        for name, case in cases.items():
            try:
                with count_traffic() as traffic:
                    ran = runner(case)
            except Exception:  # reported to the parent, which asserts on it
                (out / f"{name}.rank{rank}.error").write_text(traceback.format_exc())
                raise
            if rank == 0:
                torch.save(ran.outputs, out / f"{name}.pt")
            sent = Sent(
                sent=traffic.sent,
                held_bytes=ran.held_bytes,
                moved=ran.moved,
                patterns=list(ran.patterns),
                groups=len(distributed_c10d._world.pg_map),  # no public API counts them
            )
            (out / f"{name}.rank{rank}.json").write_bytes(msgspec.json.encode(sent))


def run_alone(case: Case) -> Ran:
    """Run ``case``'s spec with its ``[parallel]`` table dropped, in this process."""
    spec = decode_spec(case.spec)
    alone = msgspec.structs.replace(case, direct=False)
    return run_case(alone, msgspec.structs.replace(spec, parallel=ParallelLayout()))
