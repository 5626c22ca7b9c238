"""The attention sites a component declares before it is built."""

from __future__ import annotations

from typing import Annotated

import msgspec

from attention import (
    Attention,
    AttentionRequirements,
    AttentionRole,
    BackendRequest,
    ComponentRequests,
)

NO_REQUIREMENTS = AttentionRequirements()


class AttentionSite(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """One kind of attention layer a component will build, declared up front.

    Admission plans a backend for each site from this declaration alone; every
    ``attention.Attention`` the component constructs names its site, and must
    end up with the planned backend.

    Attributes:
        name: the site's name, unique in the component (``self``, ``cross``, ``mid``).
        role: what the layers attend to.
        heads: attention heads per layer (a parallel layout must divide them).
        requirements: the capabilities the layers need from their kernel.
        supported: the backends the layers accept, or None for any.
        default: the backend the layers use when nothing was asked.
    """

    name: str
    role: AttentionRole
    heads: Annotated[int, msgspec.Meta(ge=1)]
    requirements: AttentionRequirements = NO_REQUIREMENTS
    supported: frozenset[str] | None = None
    default: str | None = None

    def request_in(self, requests: ComponentRequests) -> BackendRequest:
        """Return this site's selection problem under a component's ``requests``.

        A layer built by ``build_layer`` inside that component's scope poses the same one.
        """
        return requests.for_site(
            self.name,
            self.role,
            requirements=self.requirements,
            supported=self.supported,
            default=self.default,
        )

    def build_layer(self, scale: float | None = None) -> Attention:
        """Construct one attention layer of this site, exactly as declared.

        ``scale`` is the layer's softmax scale (None: ``1 / sqrt(D)``; T5 uses 1): how
        the kernel is called, not what admission plans.

        Every custom-path layer is built here, so the declaration admission plans from
        and the layer that runs cannot diverge. Build it inside the component's
        ``attention.component_attention_scope`` to honour its requests and plan.

        Raises:
            BackendSelectionError: no backend may serve the site (see ``select_backend``).
        """
        return Attention(
            self.name,
            self.role,
            requirements=self.requirements,
            supported=self.supported,
            default=self.default,
            scale=scale,
        )
