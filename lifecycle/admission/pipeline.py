"""Admit a whole pipeline: every check, every component, every refusal at once.

Nothing here touches a weight or a device; files are read for their headers, and
the offload folder is tried and removed again. Each component's refusals
are filed under the ``admit`` guard that found them (the guards of the
transition table read them back), so a pipeline is refused with every reason
of every component at once. The checks live beside this module, one file each.
"""

from __future__ import annotations

from collections.abc import Mapping
from functools import partial

import msgspec
import torch

from attention import ComponentRequests, PlannedSelection, Platform
from attention import registry as backends
from components import registry as kinds
from components.dtypes import TORCH_DTYPES
from components.loader import ComponentLoader
from lifecycle.admission.acceleration import acceleration_refusals, size_quantized
from lifecycle.admission.adapters import AdapterAdmission, admit_adapters
from lifecycle.admission.backends import backend_requests, plan_sites, unconsumed_refusals
from lifecycle.admission.budget import SharedBudget, budget_refusals, declared_bytes
from lifecycle.admission.cache import cache_refusals
from lifecycle.admission.construction import construct_module
from lifecycle.admission.dtypes import dtype_refusals
from lifecycle.admission.folder import default_steps, open_folder
from lifecycle.admission.host_memory import available_host_bytes, host_memory_refusals
from lifecycle.admission.interfaces import interface_refusals
from lifecycle.admission.loader_path import (
    choose_path,
    native_backend_refusals,
    native_layout_refusals,
)
from lifecycle.admission.offload_dir import offload_dir_refusals
from lifecycle.admission.parallel_layout import (
    fsdp_refusals,
    head_refusals,
    layout_refusals,
    sharded_offload_refusals,
    split_refusals,
)
from lifecycle.admission.residency import residency_refusals
from lifecycle.admission.variants import variant_refusals
from lifecycle.admission.weight_files import weights_refusals
from lifecycle.machines.tables import Guard
from lifecycle.plan import ComponentPlan, SitePlan
from lifecycle.refusals import Refusal, RefusalCode
from lifecycle.spec.structs import ComponentSpec, PipelineSpec

__all__ = ["Admission", "ComponentAdmission", "admit_pipeline", "component_loaders"]


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
    refusals: dict[Guard, tuple[Refusal, ...]]
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
        adapters: each adapter's admission (design §14).
    """

    pipeline: str
    components: dict[str, ComponentAdmission]
    pipeline_refusals: tuple[Refusal, ...] = ()
    adapters: dict[str, AdapterAdmission] = msgspec.field(default_factory=dict)

    @property
    def admitted(self) -> bool:
        """Tell whether nothing was refused."""
        return not self.refusals()

    def refusals(self) -> tuple[Refusal, ...]:
        """Return every refusal: the pipeline's first, then each component's, each adapter's."""
        per_component = (r for c in self.components.values() for r in c.all_refusals())
        per_adapter = (r for a in self.adapters.values() for r in a.refusals)
        return (*self.pipeline_refusals, *per_component, *per_adapter)


def admit_pipeline(
    spec: PipelineSpec,
    platform: Platform,
    loaders: Mapping[str, ComponentLoader] | None = None,
    shared: SharedBudget | None = None,
    *,
    served: bool = False,
) -> Admission:
    """Plan every component of ``spec`` on ``platform``, collecting every refusal.

    ``loaders`` are the components' loaders when the caller already holds them
    (the orchestrator does); otherwise they are made from the spec. ``shared`` is the
    budget of a worker that serves it beside other pipelines, if any; ``served``: a worker
    serves it, so a pipeline that makes videos keeps its finished MP4s on the host
    (``serving.video_store_bytes``), which the host memory check counts. A pipeline from
    a folder is held to what its folder and recipe say (``lifecycle.admission.folder``).
    """
    if loaders is None:
        loaders = component_loaders(spec)
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
    builders = {
        name: partial(
            construct_module,
            path,
            components[name].requests,
            components[name].planned,
            platform,
            partial(loaders[name].construct, path),
        )
        for name, path in paths.items()
        if path is not None
    }
    folder = None if isinstance(spec.source, msgspec.UnsetType) else open_folder(spec, loaders)
    steps = default_steps(None if folder is None else folder.recipe)
    recipe = None if folder is None else folder.recipe
    stored = spec.serving.video_store if served and recipe and recipe.makes_videos else 0
    return Admission(
        pipeline=spec.name,
        components=components,
        pipeline_refusals=(
            *device_refusals(spec),
            *layout_refusals(spec),
            *split_refusals(spec, loaders, paths),
            *fsdp_refusals(spec, loaders, paths),
            *sharded_offload_refusals(spec, loaders, paths, platform),
            *budget_refusals(spec, loaders, shared),
            *host_memory_refusals(spec, loaders, available_host_bytes(), stored),
            *offload_dir_refusals(spec),
            *dtype_refusals(spec, loaders, platform),
            *(
                interface_refusals(spec, {n: loaders[n] for n, p in paths.items() if p})
                if folder is None
                else folder.refusals
            ),
            *unused_option_refusals(spec, components),
            *cache_refusals(spec, loaders, paths, steps),
            *acceleration_refusals(
                spec,
                loaders,
                paths,
                {name: admitted.plan.attention for name, admitted in components.items()},
                platform,
            ),
        ),
        adapters=admit_adapters(spec, paths, builders),
    )


def component_loaders(spec: PipelineSpec) -> dict[str, ComponentLoader]:
    """Return each component's loader: its kind's, with its options, in its dtype, with
    its step cache, quantization and compile mode.

    Raises:
        msgspec.ValidationError: an option is bad (decoding the spec refuses that first).
    """
    loaders = {}
    for name, component in spec.components.items():
        loader = kinds.get(component.kind).from_options(component.options)
        loader.dtype = TORCH_DTYPES[spec.dtype_of(name)]
        loader.cache = component.cache_settings
        loader.quantization = component.quantization_mode
        loader.compile = component.compile_mode
        loaders[name] = loader
    return loaders


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
    refusals: dict[Guard, list[Refusal]] = {
        Guard.ATTENTION_PLAN: [],
        Guard.LOADER_PATH: [],
        Guard.RESIDENCY_USE: [],
        Guard.BACKENDS_CONSUMABLE: [],
    }
    # a variant the folder lacks would make each loading path say so again
    refusals[Guard.LOADER_PATH] += variant_refusals(name, loader)
    path = (
        None
        if refusals[Guard.LOADER_PATH]
        else choose_path(name, component, loader, refusals[Guard.LOADER_PATH])
    )
    if path is not None:
        refusals[Guard.LOADER_PATH] += weights_refusals(name, loader)
    declared = loader.sites() if path == "custom" else None
    planned = None
    if path == "native":
        refusals[Guard.LOADER_PATH] += native_layout_refusals(name, component, spec, loader)
        refusals[Guard.BACKENDS_CONSUMABLE] += native_backend_refusals(name, component)
    elif declared is not None:
        planned = plan_sites(requests, declared, platform, refusals[Guard.ATTENTION_PLAN])
        refusals[Guard.BACKENDS_CONSUMABLE] += unconsumed_refusals(requests, declared, planned)
        refusals[Guard.LOADER_PATH] += head_refusals(name, spec, loader, declared)
    construct = (
        None
        if path is None
        else partial(
            construct_module, path, requests, planned, platform, partial(loader.construct, path)
        )
    )
    refusals[Guard.RESIDENCY_USE] += residency_refusals(name, component, loader, used, construct)
    if construct is not None:
        size_quantized(loader, construct)
    return ComponentAdmission(
        plan=ComponentPlan(
            kind=component.kind,
            loader=path,
            residency=component.residency_mode,
            dtype=spec.dtype_of(name),
            bytes=declared_bytes(loader),
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
