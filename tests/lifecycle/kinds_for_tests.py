"""Small real component kinds the orchestrator tests register for themselves."""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import nn

from attention import AttentionRole
from components.generic import GenericLoader
from components.loader import ComponentLoader, PathUnavailable
from components.sites import AttentionSite

# B batch, H heads, S seq, D head dim


class SelfAttentionNet(nn.Module):
    """One projection and one self-attention layer: enough to carry a site."""

    def __init__(self, site: AttentionSite | None) -> None:
        super().__init__()
        self.proj = nn.Linear(16, 16)
        self.attn = site.build_layer() if site is not None else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Project ``x`` (B, S, 16) and attend over it with two heads."""
        h = self.proj(x).unflatten(-1, (2, 8)).transpose(1, 2)  # (B, H, S, D)
        if self.attn is not None:
            h = self.attn(h, h, h)
        return h.transpose(1, 2).flatten(-2)


SITE = AttentionSite(name="self", role=AttentionRole.SELF, heads=2)


class NativeOnlyKind(ComponentLoader):
    """A kind whose custom path is unavailable at load time; it records native builds."""

    kind: ClassVar[str] = "test_native_only"
    native_builds: ClassVar[list[str]] = []

    def sites(self) -> tuple[AttentionSite, ...]:
        """Declare one self-attention site."""
        return (SITE,)

    def build_custom(self) -> nn.Module:
        """Fail the way a missing optional library would."""
        raise PathUnavailable("the custom kernels of test_native_only are not compiled here")

    def build_native(self) -> nn.Module:
        """Build without the attention package, and record that native code ran."""
        type(self).native_builds.append("built")
        return SelfAttentionNet(None)


class BrokenKind(ComponentLoader):
    """A kind whose build allocates, then raises half-way."""

    kind: ClassVar[str] = "test_broken"
    allocated: ClassVar[list[nn.Module]] = []

    def sites(self) -> tuple[AttentionSite, ...]:
        """Declare one self-attention site."""
        return (SITE,)

    def build_custom(self) -> nn.Module:
        """Build a real module, then fail as an I/O error would."""
        type(self).allocated.append(SelfAttentionNet(SITE))
        raise OSError("weights file truncated")


class UndeclaredSiteKind(ComponentLoader):
    """A kind that declares no site but builds an attention layer anyway."""

    kind: ClassVar[str] = "test_undeclared_site"

    def build_custom(self) -> nn.Module:
        """Build a layer the declaration does not mention."""
        return SelfAttentionNet(SITE)


class ValueDependentKind(ComponentLoader):
    """A kind whose build reads a tensor's value, which the meta device does not hold."""

    kind: ClassVar[str] = "test_value_dependent"
    block_stack = "blocks"

    def block_count(self) -> int:
        """Declare the two blocks."""
        return 2

    def build_custom(self) -> nn.Module:
        """Size the blocks from a tensor's value, then stack them in a ModuleList."""
        width = int(torch.full((1,), 16).item())
        net = nn.Module()
        net.blocks = nn.ModuleList(nn.Linear(width, width) for _ in range(2))
        return net


def make_generic_module() -> nn.Module:
    """Return a module with one attention layer, for the generic loader's factory."""
    return SelfAttentionNet(SITE)


def make_plain_module() -> nn.Module:
    """Return a module without attention, for the generic loader's factory."""
    return SelfAttentionNet(None)


# What the registry makes of an entry point that names a plain factory.
GenericKind = GenericLoader.for_factory("test_generic", make_generic_module)
PlainGenericKind = GenericLoader.for_factory("test_generic_plain", make_plain_module)
