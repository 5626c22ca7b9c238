"""What a third-party package would ship: kinds, a factory kind and attention backends.

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


class RankBugKind(EchoKind):
    """A plugin kind with a bug that rank 1 of a process group meets: an uncaught error."""

    kind: ClassVar[str] = "plugin_rank_bug"

    def run(self, module: nn.Module, batch: Batch) -> None:
        """Raise what no run catches on rank 1, as a kind's bug would; echo elsewhere."""
        if dist.is_initialized() and dist.get_rank() == 1:
            raise ValueError("a bug of rank 1")
        super().run(module, batch)


class SequentialNet(nn.Module):
    """Two blocks, stacked in an ``nn.Sequential`` rather than an ``nn.ModuleList``."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Run both blocks on ``x`` (B, S, 16)."""
        out: torch.Tensor = self.blocks(x)
        return out


class SequentialStackKind(ComponentLoader):
    """A plugin kind that declares a block stack, but builds it as an ``nn.Sequential``."""

    kind: ClassVar[str] = "plugin_sequential_stack"
    options_type = SeededOptions
    block_stack = "blocks"

    def block_count(self) -> int:
        """Declare the two blocks."""
        return 2

    def build_custom(self) -> nn.Module:
        """Build the two blocks in a Sequential."""
        return SequentialNet()

    def run(self, module: nn.Module, batch: Batch) -> None:
        """Run the blocks on seeded tokens; nothing is handed on."""
        x = torch.randn(batch.size, 4, 16, generator=batch.generator)  # (B, S, 16)
        module(x.to(device_of(module)))


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
