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
    BackendRequest,
    BackendSelectionError,
    Platform,
    Provenance,
    select_backend,
)
from attention import registry as backends
from components import ResidencyMode
from components import registry as kinds
from components.loader import ComponentLoader, LoaderPath
from components.sites import AttentionSite
from lifecycle.budget import stage_fits
from lifecycle.config import ALL_ROLES, ComponentSpec, PipelineSpec
from lifecycle.parallel_admission import split_refusals
from lifecycle.plan import ComponentPlan, SitePlan
from lifecycle.refusals import Refusal

ATTENTION_PLAN = "attention_plan"
LOADER_PATH = "loader_path"
RESIDENCY_USE = "residency_use"
BACKENDS_CONSUMABLE = "backends_consumable"


class ComponentAdmission(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """What admission found for one component.

    Attributes:
        plan: how it would be loaded (partial where something was refused).
        refusals: guard name -> the refusals that guard raises.
        sites_known: whether its kind declares its attention sites (a generic
            kind's are known only once it is built).
    """

    plan: ComponentPlan
    refusals: dict[str, tuple[Refusal, ...]]
    sites_known: bool = True

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
    components = {
        name: admit_component(name, component, loaders[name], spec, platform, name in used)
        for name, component in spec.components.items()
    }
    return Admission(
        pipeline=spec.name,
        components=components,
        pipeline_refusals=(
            *device_refusals(spec),
            *layout_refusals(spec),
            *split_refusals(spec, loaders, {n: c.plan.loader for n, c in components.items()}),
            *budget_refusals(spec, loaders),
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
    if any(c.plan.loader == "custom" and not c.sites_known for c in components.values()):
        return []
    planned = {site.backend for c in components.values() for site in c.plan.attention}
    return [
        Refusal(
            code="attention.backend_not_consumed",
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
    name: str,
    component: ComponentSpec,
    loader: ComponentLoader,
    spec: PipelineSpec,
    platform: Platform,
    used: bool,
) -> ComponentAdmission:
    """Plan one component: its loading path, its attention sites, its residency."""
    refusals: dict[str, list[Refusal]] = {
        ATTENTION_PLAN: [],
        LOADER_PATH: [],
        RESIDENCY_USE: [],
        BACKENDS_CONSUMABLE: [],
    }
    path = _choose_path(name, component, loader, refusals[LOADER_PATH])
    sites: tuple[SitePlan, ...] = ()
    if path == "native":
        refusals[LOADER_PATH] += native_layout_refusals(name, component, spec, loader)
        refusals[BACKENDS_CONSUMABLE] += native_backend_refusals(name, component)
    elif path == "custom":
        declared = loader.sites()
        if declared is not None:
            sites = _plan_sites(name, component, spec, loader, declared, platform, refusals)
            refusals[BACKENDS_CONSUMABLE] += _unconsumed(name, component, declared)
            refusals[LOADER_PATH] += _head_refusals(name, spec, loader, declared)
    refusals[RESIDENCY_USE] += _residency_refusals(name, component, loader, used)
    return ComponentAdmission(
        plan=ComponentPlan(
            kind=component.kind,
            loader=path,
            residency=component.residency_mode,
            attention=sites,
        ),
        refusals={guard: tuple(found) for guard, found in refusals.items()},
        sites_known=loader.sites() is not None,
    )


def device_refusals(spec: PipelineSpec) -> list[Refusal]:
    """Refuse ``device = "cuda"`` in a process that sees no CUDA device."""
    if spec.device != "cuda" or torch.cuda.is_available():
        return []
    return [
        Refusal(
            code="loader.unavailable",
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
            code="parallel.invalid_layout",
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
        name
        for name, component in spec.components.items()
        if name in sizes
        and not isinstance(component.residency, UnsetType)
        and component.residency_mode is ResidencyMode.RESIDENT
    )
    found = []
    for stage in spec.stages:
        uses = tuple(name for name in stage.uses if name in sizes)
        if uses and (refusal := stage_fits(stage.name, sizes, uses, pinned, budget)):
            found.append(refusal)
    return found


def _declared_bytes(loader: ComponentLoader) -> int | None:
    """Return the declared size, or None when unknown or unreadable (refused elsewhere)."""
    try:
        return loader.declared_bytes()
    except (OSError, ValueError):
        return None  # a missing or broken weights file is the loader path's refusal


def native_fallback_refusals(
    name: str, component: ComponentSpec, spec: PipelineSpec, loader: ComponentLoader
) -> list[Refusal]:
    """Return why ``name`` may not fall back to its native path (DESIGN.md §5.1)."""
    return [
        *native_layout_refusals(name, component, spec, loader),
        *native_backend_refusals(name, component),
    ]


class BackendRequests(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """What the spec asks of one component's attention: the scope's arguments.

    Admission plans each site from these, and loading builds the component's
    ``attention.component_attention_scope`` from the very same values.
    """

    component_backend: BackendChoice | None
    role_backends: dict[AttentionRole, BackendChoice]
    global_backend: BackendChoice | None
    allow_global_fallback: bool
    ring: bool


def backend_requests(
    spec: PipelineSpec, component: ComponentSpec, loader: ComponentLoader
) -> BackendRequests:
    """Return the attention requests the spec makes for one component (all explicit)."""
    written = component.role_backends()
    return BackendRequests(
        component_backend=_explicit(written.get(ALL_ROLES)),
        role_backends={
            role: BackendChoice(name=written[role.value], provenance=Provenance.EXPLICIT)
            for role in AttentionRole
            if role.value in written
        },
        global_backend=_explicit(spec.attention.backend),
        allow_global_fallback=loader.allows_global_fallback,
        # ring attention applies to the self-attention of kinds that split sequences
        ring=spec.parallel.ring_degree > 1 and loader.sequence_parallel,
    )


def _explicit(name: str | UnsetType | None) -> BackendChoice | None:
    if name is None or isinstance(name, UnsetType):
        return None
    return BackendChoice(name=name, provenance=Provenance.EXPLICIT)


def backend_options(spec: PipelineSpec) -> dict[str, msgspec.Struct]:
    """Return each configured backend's options, validated by its backend."""
    return {
        name: msgspec.convert(raw, backends.get(name).options_type)
        for name, raw in spec.attention.backend_options.items()
    }


def _choose_path(
    name: str, component: ComponentSpec, loader: ComponentLoader, found: list[Refusal]
) -> LoaderPath | None:
    if not isinstance(component.loader, UnsetType):
        reason = loader.unavailable_reason(component.loader)
        if reason is None:
            return component.loader
        found.append(
            Refusal(
                code="loader.unavailable",
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
            code="loader.unavailable",
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
            code="loader.native_parallel_layout",
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
            code="loader.native_explicit_backend",
            component=name,
            message=f"backend '{backend}' was requested for component '{name}' "
            f"({'component-wide' if key == ALL_ROLES else key + '-attention'}), but it "
            "loads through a native path, which does not use the attention package",
            hint=f'remove components.{name}.attention_backend, or load it with loader = "custom"',
        )
        for key, backend in component.role_backends().items()
    ]


def _plan_sites(
    name: str,
    component: ComponentSpec,
    spec: PipelineSpec,
    loader: ComponentLoader,
    declared: tuple[AttentionSite, ...],
    platform: Platform,
    refusals: Mapping[str, list[Refusal]],
) -> tuple[SitePlan, ...]:
    asked = backend_requests(spec, component, loader)
    planned = []
    for site in declared:
        request = BackendRequest(
            component=name,
            site=site.name,
            role=site.role,
            requirements=site.requirements,
            supported=site.supported,
            layer_default=site.default,
            role_override=asked.role_backends.get(site.role),
            component_override=asked.component_backend,
            global_backend=asked.global_backend,
            allow_global_fallback=asked.allow_global_fallback,
            ring=asked.ring and site.role is AttentionRole.SELF,
        )
        try:
            selection = select_backend(request, platform)
        except BackendSelectionError as err:
            refusals[ATTENTION_PLAN].append(
                Refusal(code=err.code, component=name, message=err.message, hint=err.hint)
            )
            continue
        planned.append(
            SitePlan(
                site=site.name,
                role=site.role,
                backend=selection.backend,
                provenance=selection.provenance,
                reason=selection.reason,
            )
        )
    return tuple(planned)


def _unconsumed(
    name: str, component: ComponentSpec, declared: tuple[AttentionSite, ...]
) -> list[Refusal]:
    """Refuse explicit backends that would govern no layer the component builds.

    A role key governs its role; ``all`` governs the roles no role key names.
    """
    written = component.role_backends()
    built = {site.role.value for site in declared}
    found = []
    for key, backend in written.items():
        governed = (
            {role.value for role in AttentionRole} - set(written) if key == ALL_ROLES else {key}
        )
        if governed & built:
            continue
        if not declared:
            message = (
                f"backend '{backend}' was requested for component '{name}', but that "
                "component constructs no attention layers"
            )
        else:
            roles = " or ".join(f"{role}-attention" for role in sorted(governed)) or "no"
            message = (
                f"backend '{backend}' was requested for the {roles} layers of component "
                f"'{name}' ({key}), but it builds none "
                f"(only {', '.join(sorted(built))}-attention"
                + (
                    ", and the role keys replace 'all' for every other role)"
                    if key == ALL_ROLES
                    else ")"
                )
            )
        found.append(
            Refusal(
                code="attention.backend_not_consumed",
                component=name,
                message=message,
                hint=f"remove the '{key}' backend from components.{name}.attention_backend",
            )
        )
    return found


def _head_refusals(
    name: str, spec: PipelineSpec, loader: ComponentLoader, declared: tuple[AttentionSite, ...]
) -> list[Refusal]:
    if not loader.sequence_parallel:
        return []  # its custom path replicates the component on every rank
    return [
        Refusal(
            code="parallel.invalid_layout",
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
    if mode is ResidencyMode.LAYERWISE_OFFLOAD and loader.block_stack is None:
        found.append(
            Refusal(
                code="residency.not_offloadable",
                component=name,
                message=f"component '{name}' asks for layerwise_offload, but kind "
                f"'{component.kind}' declares no block stack to stream",
                hint=f'use residency = "component_offload" for {name}',
            )
        )
    if not used and mode is not ResidencyMode.RESIDENT:
        found.append(
            Refusal(
                code="residency.undeclared_use",
                component=name,
                message=f"component '{name}' is explicitly {mode.value}, but no stage uses "
                "it, so nothing would ever onload it",
                hint=f"add '{name}' to the uses of the stage that needs it, or remove "
                f"components.{name}.residency",
            )
        )
    return found
