"""Admission: pure checks from a spec and a platform to a plan, or to every refusal.

Nothing here touches a weight, a file or a device. Each component's refusals
are filed under the ``admit`` guard that found them (the guards of the
transition table read them back), so a pipeline is refused with every reason
of every component at once.
"""

from __future__ import annotations

from collections.abc import Mapping

import msgspec
import torch
from msgspec import UnsetType

from attention import (
    AttentionRole,
    BackendChoice,
    BackendSelectionError,
    ComponentRequests,
    PlannedSelection,
    Platform,
    Provenance,
    SelectionRecord,
    select_backend,
    unconsumed,
)
from attention import registry as backends
from components import ResidencyMode
from components import registry as kinds
from components.loader import ComponentLoader, LoaderPath
from components.offload.layerwise_limits import layerwise_problems
from components.sites import AttentionSite
from lifecycle.budget import stage_fits
from lifecycle.config import ALL_ROLES, ComponentSpec, PipelineSpec
from lifecycle.interfaces import interface_refusals
from lifecycle.parallel_admission import sharded_offload_refusals, split_refusals
from lifecycle.plan import ComponentPlan, SitePlan
from lifecycle.refusals import Refusal, RefusalCode
from lifecycle.weight_files import weights_refusals

ATTENTION_PLAN = "attention_plan"
LOADER_PATH = "loader_path"
RESIDENCY_USE = "residency_use"
BACKENDS_CONSUMABLE = "backends_consumable"


class ComponentAdmission(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """What admission found for one component.

    Attributes:
        plan: how it would be loaded (partial where something was refused).
        refusals: guard name -> the refusals that guard raises.
        requests: what the spec asks of its attention; loading scopes it with these.
        planned: site -> its admitted selection, for a custom path whose kind declares
            its sites; None when the sites are known only once built (a generic kind)
            or the component builds no attention layers of ours (a native path).
    """

    plan: ComponentPlan
    refusals: dict[str, tuple[Refusal, ...]]
    requests: ComponentRequests
    planned: dict[str, PlannedSelection] | None = None

    def all_refusals(self) -> tuple[Refusal, ...]:
        """Return every refusal, in guard order."""
        return tuple(r for found in self.refusals.values() for r in found)


class Admission(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """What admission found for a whole pipeline.

    Attributes:
        pipeline: the pipeline's name.
        components: each component's admission.
        pipeline_refusals: refusals that belong to no single component (the layout).
    """

    pipeline: str
    components: dict[str, ComponentAdmission]
    pipeline_refusals: tuple[Refusal, ...] = ()

    @property
    def admitted(self) -> bool:
        """Tell whether nothing was refused."""
        return not self.refusals()

    def refusals(self) -> tuple[Refusal, ...]:
        """Return every refusal: the pipeline's first, then each component's."""
        per_component = (r for c in self.components.values() for r in c.all_refusals())
        return (*self.pipeline_refusals, *per_component)


def admit_pipeline(
    spec: PipelineSpec,
    platform: Platform,
    loaders: Mapping[str, ComponentLoader] | None = None,
) -> Admission:
    """Plan every component of ``spec`` on ``platform``, collecting every refusal.

    ``loaders`` are the components' loaders when the caller already holds them
    (the orchestrator does); otherwise they are made from the spec.
    """
    if loaders is None:
        loaders = {
            name: kinds.get(component.kind).from_options(component.options)
            for name, component in spec.components.items()
        }
    used = {name for stage in spec.stages for name in stage.uses}
    options = {
        name: backends.decode_options(name, raw)
        for name, raw in spec.attention.backend_options.items()
    }
    components = {
        name: admit_component(
            backend_requests(spec, name, loaders[name], options),
            component,
            loaders[name],
            spec,
            platform,
            name in used,
        )
        for name, component in spec.components.items()
    }
    paths = {name: admitted.plan.loader for name, admitted in components.items()}
    return Admission(
        pipeline=spec.name,
        components=components,
        pipeline_refusals=(
            *device_refusals(spec),
            *layout_refusals(spec),
            *split_refusals(spec, loaders, paths),
            *sharded_offload_refusals(spec, loaders, paths, platform),
            *budget_refusals(spec, loaders),
            *interface_refusals(spec, loaders),
            *unused_option_refusals(spec, components),
        ),
    )


def unused_option_refusals(
    spec: PipelineSpec, components: Mapping[str, ComponentAdmission]
) -> list[Refusal]:
    """Refuse options for a backend that no planned attention site runs.

    A generic component's sites are known only at load, so while one may run
    custom code, any backend may still use its options.
    """
    if any(c.plan.loader == "custom" and c.planned is None for c in components.values()):
        return []
    planned = {site.backend for c in components.values() for site in c.plan.attention}
    return [
        Refusal(
            code=RefusalCode.BACKEND_NOT_CONSUMED,
            component=spec.name,
            message=f"options were given for backend '{backend}' "
            f"([attention.backend_options.{backend}]), but no attention site of the "
            "pipeline runs it",
            hint=f"remove [attention.backend_options.{backend}], or request '{backend}' "
            "for the component that should use it",
        )
        for backend in spec.attention.backend_options
        if backend not in planned
    ]


def admit_component(
    requests: ComponentRequests,
    component: ComponentSpec,
    loader: ComponentLoader,
    spec: PipelineSpec,
    platform: Platform,
    used: bool,
) -> ComponentAdmission:
    """Plan one component: its loading path, its attention sites, its residency."""
    name = requests.component
    refusals: dict[str, list[Refusal]] = {
        ATTENTION_PLAN: [],
        LOADER_PATH: [],
        RESIDENCY_USE: [],
        BACKENDS_CONSUMABLE: [],
    }
    path = _choose_path(name, component, loader, refusals[LOADER_PATH])
    if path is not None:
        refusals[LOADER_PATH] += weights_refusals(name, loader)
    declared = loader.sites() if path == "custom" else None
    planned = None
    if path == "native":
        refusals[LOADER_PATH] += native_layout_refusals(name, component, spec, loader)
        refusals[BACKENDS_CONSUMABLE] += native_backend_refusals(name, component)
    elif declared is not None:
        planned = _plan_sites(requests, declared, platform, refusals[ATTENTION_PLAN])
        refusals[BACKENDS_CONSUMABLE] += _unconsumed(requests, declared, planned)
        refusals[LOADER_PATH] += _head_refusals(name, spec, loader, declared)
    refusals[RESIDENCY_USE] += _residency_refusals(name, component, loader, used)
    return ComponentAdmission(
        plan=ComponentPlan(
            kind=component.kind,
            loader=path,
            residency=component.residency_mode,
            attention=tuple(
                SitePlan(
                    site=site,
                    role=p.request.role,
                    backend=p.selection.backend,
                    provenance=p.selection.provenance,
                    reason=p.selection.reason,
                )
                for site, p in (planned or {}).items()
            ),
        ),
        refusals={guard: tuple(found) for guard, found in refusals.items()},
        requests=requests,
        planned=planned,
    )


def device_refusals(spec: PipelineSpec) -> list[Refusal]:
    """Refuse ``device = "cuda"`` in a process that sees no CUDA device."""
    if spec.device != "cuda" or torch.cuda.is_available():
        return []
    return [
        Refusal(
            code=RefusalCode.LOADER_UNAVAILABLE,
            component=spec.name,
            message='device = "cuda" was asked for, but this process sees no CUDA device',
            hint='set device = "auto" (CUDA where present, else the CPU) or "cpu", or run '
            "where a GPU is visible",
        )
    ]


def layout_refusals(spec: PipelineSpec) -> list[Refusal]:
    """Return a ``parallel.invalid_layout`` refusal for each broken layout invariant."""
    return [
        Refusal(
            code=RefusalCode.INVALID_LAYOUT,
            component=spec.name,
            message=problem,
            hint="set [parallel] sp_degree = ulysses_degree x ring_degree x "
            "kv_gather_degree, and use kv_gather_degree > 1 only with "
            "ulysses_degree = ring_degree = 1",
        )
        for problem in spec.parallel.check()
    ]


def budget_refusals(spec: PipelineSpec, loaders: Mapping[str, ComponentLoader]) -> list[Refusal]:
    """Refuse a pipeline one of whose stages cannot fit the memory budget at all.

    Sizes are declared by the kinds (or read from weights-file headers); a
    component of unknown size, and a layerwise one (whose footprint depends on
    its blocks), is checked when it onloads instead.
    """
    budget = spec.memory.device_budget
    if isinstance(budget, UnsetType):
        return []
    sizes = {
        name: size
        for name, component in spec.components.items()
        if component.residency_mode is not ResidencyMode.LAYERWISE_OFFLOAD
        and (size := _declared_bytes(loaders[name])) is not None
    }
    pinned = tuple(
        name for name, component in spec.components.items() if name in sizes and component.is_pinned
    )
    found = []
    for stage in spec.stages:
        uses = tuple(name for name in stage.uses if name in sizes)
        if uses and (refusal := stage_fits(stage.name, sizes, uses, pinned, budget)):
            found.append(refusal)
    # load() onloads a resident component even when no stage uses it
    staged = {name for stage in spec.stages for name in stage.uses}
    for name, component in spec.components.items():
        if (
            name in sizes
            and name not in staged
            and component.residency_mode is ResidencyMode.RESIDENT
            and (refusal := stage_fits("load()", sizes, (name,), pinned, budget))
        ):
            found.append(refusal)
    return found


def _declared_bytes(loader: ComponentLoader) -> int | None:
    """Return the declared size, or None when unknown or unreadable (refused elsewhere)."""
    try:
        return loader.declared_bytes()
    except (OSError, ValueError):
        return None  # a missing or broken weights file is the loader path's refusal


def backend_requests(
    spec: PipelineSpec,
    name: str,
    loader: ComponentLoader,
    options: Mapping[str, msgspec.Struct],
) -> ComponentRequests:
    """Return what the spec asks of component ``name``'s attention (every request explicit)."""
    written = spec.components[name].role_backends()
    return ComponentRequests(
        component=name,
        component_backend=_explicit(written.get(ALL_ROLES)),
        role_backends={
            role: BackendChoice(name=written[role.value], provenance=Provenance.EXPLICIT)
            for role in AttentionRole
            if role.value in written
        },
        global_backend=_explicit(spec.attention.backend),
        allow_global_fallback=loader.allows_global_fallback,
        ring=spec.parallel.ring_degree > 1 and loader.sequence_parallel,
        backend_options=dict(options),
    )


def _explicit(name: str | UnsetType | None) -> BackendChoice | None:
    if name is None or isinstance(name, UnsetType):
        return None
    return BackendChoice(name=name, provenance=Provenance.EXPLICIT)


def _choose_path(
    name: str, component: ComponentSpec, loader: ComponentLoader, found: list[Refusal]
) -> LoaderPath | None:
    if not isinstance(component.loader, UnsetType):
        reason = loader.unavailable_reason(component.loader)
        if reason is None:
            return component.loader
        found.append(
            Refusal(
                code=RefusalCode.LOADER_UNAVAILABLE,
                component=name,
                message=f"loader = '{component.loader}' was asked for, but {reason}",
                hint=f"remove components.{name}.loader to let the kind choose, or "
                "install what the path needs",
            )
        )
        return None
    custom_reason = loader.unavailable_reason("custom")
    if custom_reason is None:
        return "custom"
    native_reason = loader.unavailable_reason("native")
    if native_reason is None:
        return "native"
    found.append(
        Refusal(
            code=RefusalCode.LOADER_UNAVAILABLE,
            component=name,
            message=f"no loading path can build kind '{component.kind}' here: "
            f"{custom_reason}; {native_reason}",
            hint="register a kind with a custom or native path, or install what it needs",
        )
    )
    return None


def native_layout_refusals(
    name: str, component: ComponentSpec, spec: PipelineSpec, loader: ComponentLoader
) -> list[Refusal]:
    """Refuse a native path for a layout that splits the model (tp, sp, ..., FSDP)."""
    asked = spec.parallel.splits(name)
    if not asked:
        return []
    why = (
        ""
        if isinstance(component.loader, str)
        else f" (its custom path is unavailable: {loader.unavailable_reason('custom')})"
    )
    return [
        Refusal(
            code=RefusalCode.NATIVE_PARALLEL_LAYOUT,
            component=name,
            message=f"component '{name}' would load natively{why}, and a native path "
            f"cannot honour the parallel layout ({', '.join(asked)})",
            hint="use a kind with a custom path for this layout, or drop the layout to "
            "data or CFG parallel (replicated layouts work natively)",
        )
    ]


def native_backend_refusals(name: str, component: ComponentSpec) -> list[Refusal]:
    """Refuse a native path for a component with explicit attention backends."""
    return [
        Refusal(
            code=RefusalCode.NATIVE_EXPLICIT_BACKEND,
            component=name,
            message=f"backend '{backend}' was requested for component '{name}' "
            f"({'component-wide' if key == ALL_ROLES else key + '-attention'}), but it "
            "loads through a native path, which does not use the attention package",
            hint=f'remove components.{name}.attention_backend, or load it with loader = "custom"',
        )
        for key, backend in component.role_backends().items()
    ]


def _plan_sites(
    requests: ComponentRequests,
    declared: tuple[AttentionSite, ...],
    platform: Platform,
    refused: list[Refusal],
) -> dict[str, PlannedSelection]:
    """Select a backend for each declared site; file a refusal for each that has none."""
    planned = {}
    for site in declared:
        request = site.request_in(requests)
        try:
            planned[site.name] = PlannedSelection(
                request=request, selection=select_backend(request, platform)
            )
        except BackendSelectionError as err:
            refused.append(_refusal(err))
    return planned


def _unconsumed(
    requests: ComponentRequests,
    declared: tuple[AttentionSite, ...],
    planned: Mapping[str, PlannedSelection],
) -> list[Refusal]:
    """Refuse explicit backends that would govern no layer the component builds.

    Sites whose selection was refused still count as built: their backend is the
    attention plan's refusal, not this one.
    """
    records = [SelectionRecord.of(p.request, p.selection) for p in planned.values()]
    problem = unconsumed(requests, records, built_roles=(site.role for site in declared))
    return [] if problem is None else [_refusal(problem)]


def _refusal(err: BackendSelectionError) -> Refusal:
    return Refusal(
        code=RefusalCode[err.code.name], component=err.component, message=err.message, hint=err.hint
    )


def _head_refusals(
    name: str, spec: PipelineSpec, loader: ComponentLoader, declared: tuple[AttentionSite, ...]
) -> list[Refusal]:
    if not loader.sequence_parallel:
        return []  # its custom path replicates the component on every rank
    return [
        Refusal(
            code=RefusalCode.INVALID_LAYOUT,
            component=name,
            message=f"site '{site.name}': {problem}",
            hint="pick tp_size and ulysses_degree whose product divides the head count",
        )
        for site in declared
        if (problem := spec.parallel.check_heads(site.heads)) is not None
    ]


def _residency_refusals(
    name: str, component: ComponentSpec, loader: ComponentLoader, used: bool
) -> list[Refusal]:
    mode = component.residency_mode
    found = []
    if mode is ResidencyMode.LAYERWISE_OFFLOAD:
        found += _layerwise_refusals(name, component, loader)
    if not used and mode is not ResidencyMode.RESIDENT:
        found.append(
            Refusal(
                code=RefusalCode.UNDECLARED_USE,
                component=name,
                message=f"component '{name}' is explicitly {mode.value}, but no stage uses "
                "it, so nothing would ever onload it",
                hint=f"add '{name}' to the uses of the stage that needs it, or remove "
                f"components.{name}.residency",
            )
        )
    return found


def _layerwise_refusals(
    name: str, component: ComponentSpec, loader: ComponentLoader
) -> list[Refusal]:
    blocks = loader.block_count()
    if loader.block_stack is None or blocks is None:
        return [
            Refusal(
                code=RefusalCode.NOT_OFFLOADABLE,
                component=name,
                message=f"component '{name}' asks for layerwise_offload, but kind "
                f"'{component.kind}' declares no block stack to stream",
                hint=f'use residency = "component_offload" for {name}',
            )
        ]
    config = component.layerwise_config
    problems = layerwise_problems(
        blocks, prefetch=config.prefetch, resident_layers=config.resident_layers
    )
    return (
        [
            Refusal(
                code=RefusalCode.INVALID_LAYERWISE,
                component=name,
                message=f"component '{name}' streams {blocks} block{'s' if blocks != 1 else ''} "
                f"(kind '{component.kind}'), and its layerwise settings cannot be honoured: "
                f"{'; '.join(problems)}",
                hint=f"change [components.{name}.layerwise] to fit {blocks} "
                f"block{'s' if blocks != 1 else ''}",
            )
        ]
        if problems
        else []
    )
