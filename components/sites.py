"""The attention sites a component declares before it is built."""

from __future__ import annotations

from typing import Annotated

import msgspec
from torch import nn

from attention import (
    Attention,
    AttentionRequirements,
    AttentionRole,
    BackendRequest,
    ComponentRequests,
)

__all__ = ["NO_REQUIREMENTS", "AttentionSite", "SiteLayer", "build_layers"]

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


class SiteLayer(nn.Module):
    """Hold the attention layer of one declared site, built apart from the module around it.

    A custom-path module is built with empty holders: on ``meta``, to declare its
    tensors at admission, where no backend is chosen yet. The load gives that very
    module its layers (``build_layers``, inside the component's attention scope) and
    its weights, so a component is built once from admission to load.

    Args:
        site: the declared site of the layer.
        scale: the layer's softmax scale (see ``AttentionSite.build_layer``).
    """

    def __init__(self, site: AttentionSite, scale: float | None = None) -> None:
        super().__init__()
        self.site = site
        self.scale = scale
        self.built: Attention | None = None

    @property
    def layer(self) -> Attention:
        """The attention layer.

        Raises:
            RuntimeError: the module was built for its declaration only (no layer yet).
        """
        if self.built is None:
            raise RuntimeError(
                f"the '{self.site.name}' attention layer was never built: this module was "
                "built for its declaration only"
            )
        return self.built


def build_layers(module: nn.Module) -> None:
    """Build the attention layer of every ``SiteLayer`` under ``module`` that has none yet.

    Build it inside the component's ``attention.component_attention_scope``: each layer
    takes its site's planned backend there.
    """
    holders = [m for m in module.modules() if isinstance(m, SiteLayer) and m.built is None]
    for holder in holders:
        holder.built = holder.site.build_layer(holder.scale)
