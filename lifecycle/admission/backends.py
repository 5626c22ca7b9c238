"""Plan each declared attention site's backend, and refuse backends nothing would consume."""

from __future__ import annotations

from collections.abc import Mapping

import msgspec
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
from components.loader import ComponentLoader
from components.sites import AttentionSite
from lifecycle.refusals import Refusal, RefusalCode
from lifecycle.spec.structs import ALL_ROLES, PipelineSpec

__all__ = ["backend_requests", "plan_sites", "unconsumed_refusals"]


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


def plan_sites(
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
            refused.append(selection_refusal(err))
    return planned


def unconsumed_refusals(
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
    return [] if problem is None else [selection_refusal(problem)]


def selection_refusal(err: BackendSelectionError) -> Refusal:
    return Refusal(
        code=RefusalCode[err.code.name], component=err.component, message=err.message, hint=err.hint
    )
