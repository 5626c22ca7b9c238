"""The data of one layer's selection problem, and its answer."""

from __future__ import annotations

from enum import StrEnum

import msgspec

from attention.requirements import NO_REQUIREMENTS, AttentionRequirements
from attention.roles import AttentionRole, Provenance

# The reasons a selection may give for not choosing what was asked for (DESIGN §4.2).
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
    """Say which precedence level a layer's backend request came from (DESIGN §4.2)."""

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
        rejected: each refused candidate, mapped to why.
    """

    backend: str
    reason: str | None
    provenance: Provenance
    rejected: dict[str, str] = msgspec.field(default_factory=dict)
