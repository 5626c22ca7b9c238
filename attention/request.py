"""The data of one layer's selection problem, and its answer."""

from __future__ import annotations

from enum import StrEnum

import msgspec

from attention.requirements import NO_REQUIREMENTS, AttentionRequirements
from attention.roles import AttentionRole, Provenance

__all__ = [
    "DENSE_CROSS_FALLBACK",
    "GLOBAL_BACKEND_FALLBACK",
    "PLATFORM_DEFAULT_FALLBACK",
    "BackendChoice",
    "BackendRequest",
    "ComponentRequests",
    "PlannedSelection",
    "RequestSource",
    "Selection",
    "SelectionRecord",
]

# The reasons a selection may give for not choosing what was asked for (design §4.2).
PLATFORM_DEFAULT_FALLBACK = "platform default fallback"
GLOBAL_BACKEND_FALLBACK = "global backend fallback"
DENSE_CROSS_FALLBACK = "dense cross-attention fallback"


class BackendChoice(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Name a backend together with who asked for it.

    Attributes:
        name: the backend's registry name.
        provenance: explicit (strict), automatic or default (both may fall back).
    """

    name: str
    provenance: Provenance


class RequestSource(StrEnum):
    """Say which precedence level a layer's backend request came from (design §4.2)."""

    LAYER = "layer"
    ROLE = "role"
    COMPONENT = "component"
    GLOBAL = "global"
    NONE = "none"


class BackendRequest(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Describe everything one attention layer's backend selection depends on.

    Attributes:
        component: the component building the layer (named in every error).
        site: the layer's attention site, as the component declares it.
        role: self- or cross-attention.
        requirements: the capabilities the layer needs.
        supported: the backends the layer can work with, or None for any.
        layer_default: the layer's declared default backend, or None.
        layer_backend: a backend named by the layer's code (explicit), or None.
        role_override: the component's override for this role, or None.
        component_override: the component-wide override, or None.
        global_backend: the pipeline's global backend, or None.
        allow_global_fallback: the component's loader lets an explicit global backend
            fall back (auxiliary components: text encoders, VAEs).
        ring: ring attention applies to this layer, so it needs the softmax LSE.
    """

    component: str
    site: str
    role: AttentionRole
    requirements: AttentionRequirements = NO_REQUIREMENTS
    supported: frozenset[str] | None = None
    layer_default: str | None = None
    layer_backend: str | None = None
    role_override: BackendChoice | None = None
    component_override: BackendChoice | None = None
    global_backend: BackendChoice | None = None
    allow_global_fallback: bool = False
    ring: bool = False

    def requested(self) -> tuple[BackendChoice | None, RequestSource]:
        """Return the request that wins by precedence, and where it came from."""
        if self.layer_backend is not None:
            return BackendChoice(name=self.layer_backend, provenance=Provenance.EXPLICIT), (
                RequestSource.LAYER
            )
        for choice, source in (
            (self.role_override, RequestSource.ROLE),
            (self.component_override, RequestSource.COMPONENT),
            (self.global_backend, RequestSource.GLOBAL),
        ):
            if choice is not None:
                return choice, source
        return None, RequestSource.NONE


class Selection(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Say which backend a layer runs and why.

    Attributes:
        backend: the chosen backend's name.
        reason: None when the requested backend (with nothing requested: the layer
            default, else the platform default) was chosen; otherwise the fallback reason.
        provenance: the provenance of the request, not of the backend that won.
        rejected: each refused candidate, mapped to every reason it was refused, in
            the order they were checked.
    """

    backend: str
    reason: str | None
    provenance: Provenance
    rejected: dict[str, tuple[str, ...]] = msgspec.field(default_factory=dict)


class ComponentRequests(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Say what a pipeline asks of one component's attention, decided once at admission.

    Admission plans every declared site from it, and loading hands the very same value
    to the component's ``component_attention_scope``: nothing re-derives it.

    Attributes:
        component: the component's name, used in every message.
        component_backend: the component-wide override.
        role_backends: the per-role overrides; a role here beats ``component_backend``.
        global_backend: the pipeline's global backend.
        allow_global_fallback: the loader lets an explicit global backend fall back.
        ring: ring attention applies to this component (its kind splits sequences).
        backend_options: backend name -> its decoded options.
    """

    component: str
    component_backend: BackendChoice | None = None
    role_backends: dict[AttentionRole, BackendChoice] = msgspec.field(default_factory=dict)
    global_backend: BackendChoice | None = None
    allow_global_fallback: bool = False
    ring: bool = False
    backend_options: dict[str, msgspec.Struct] = msgspec.field(default_factory=dict)

    def for_site(
        self,
        site: str,
        role: AttentionRole,
        *,
        requirements: AttentionRequirements = NO_REQUIREMENTS,
        supported: frozenset[str] | None = None,
        default: str | None = None,
        backend: str | None = None,
    ) -> BackendRequest:
        """Return the selection problem of one site (or layer) of this component."""
        return BackendRequest(
            component=self.component,
            site=site,
            role=role,
            requirements=requirements,
            supported=supported,
            layer_default=default,
            layer_backend=backend,
            role_override=self.role_backends.get(role),
            component_override=self.component_backend,
            global_backend=self.global_backend,
            allow_global_fallback=self.allow_global_fallback,
            # Ring attention splits the sequence a layer attends over: only self-attention.
            ring=self.ring and role is AttentionRole.SELF,
        )


class PlannedSelection(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The backend admitted for one site, with the request it was chosen for.

    A layer built for the site gets ``selection`` only when its own request equals
    ``request``: the plan holds exactly for the layer it was made from.

    Attributes:
        request: the site's selection problem, as admission saw it.
        selection: what admission chose, and why.
    """

    request: BackendRequest
    selection: Selection


class SelectionRecord(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Remember one layer's (or planned site's) selection.

    Attributes:
        site: the layer's attention site.
        role: the layer's role.
        source: the precedence level its request came from.
        requested: the requested backend's name, or None when nothing was requested.
        selection: what was chosen, and why.
    """

    site: str
    role: AttentionRole
    source: RequestSource
    requested: str | None
    selection: Selection

    @classmethod
    def of(cls, request: BackendRequest, selection: Selection) -> SelectionRecord:
        """Record ``selection`` as the answer to ``request``."""
        requested, source = request.requested()
        return cls(
            site=request.site,
            role=request.role,
            source=source,
            requested=None if requested is None else requested.name,
            selection=selection,
        )
