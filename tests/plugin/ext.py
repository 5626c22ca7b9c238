"""What a third-party package would ship: a kind, a factory kind and an attention backend.

Nothing here is imported by the project: ``test_entry_points.py`` installs it as a
distribution whose entry points name these objects.
"""

from __future__ import annotations

from typing import ClassVar

import torch
import torch.distributed as dist
from torch import nn

from attention import AttentionBackend, AttentionImpl
from attention.testing import SdpaImpl
from components.batch import Batch, device_of
from components.loader import ComponentLoader, SeededOptions
from components.sites import AttentionSite
from tests.lifecycle.kinds_for_tests import SITE, SelfAttentionNet

# B batch, H heads, S seq, D head dim


class EchoKind(ComponentLoader):
    """A plugin kind with one declared self-attention site and a seeded custom path."""

    kind: ClassVar[str] = "plugin_echo"
    options_type = SeededOptions

    def sites(self) -> tuple[AttentionSite, ...]:
        """Declare the one self-attention site."""
        return (SITE,)

    def build_custom(self) -> nn.Module:
        """Build the network on an ``attention.Attention`` layer."""
        return SelfAttentionNet(SITE)

    def run(self, module: nn.Module, batch: Batch) -> None:
        """Attend over seeded tokens; nothing is handed on."""
        x = torch.randn(batch.size, 4, 16, generator=batch.generator)  # (B, S, 16)
        module(x.to(device_of(module)))


class RankFaultKind(EchoKind):
    """A plugin kind whose request fails on rank 1 of a process group, and runs elsewhere."""

    kind: ClassVar[str] = "plugin_rank_fault"

    def run(self, module: nn.Module, batch: Batch) -> None:
        """Raise on rank 1, as a kernel that hits a bad device would; echo elsewhere."""
        if dist.is_initialized() and dist.get_rank() == 1:
            raise RuntimeError("the device of rank 1 went away")
        super().run(module, batch)


def make_plain() -> nn.Module:
    """Return a network without attention: a kind registered as a plain factory."""
    return SelfAttentionNet(None)


class PluginBackend(AttentionBackend):
    """A dense out-of-tree backend."""

    name = "plugin_sdpa"
    impl_cls = SdpaImpl


class ClashingBackend(PluginBackend):
    """A backend that claims a built-in's name; the registry must refuse it."""

    name = "torch_sdpa"


class NoForwardImpl(AttentionImpl):
    """A kernel that forgot ``forward``."""


class IncompleteBackend(AttentionBackend):
    """A backend whose kernel cannot attend; the registry must refuse it."""

    name = "plugin_incomplete"
    impl_cls = NoForwardImpl
