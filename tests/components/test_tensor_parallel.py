"""Layers split by tensor parallel compute outside inference mode, equal to the whole layer.

Under inference mode DTensor derives a split ``linear``'s sharding by tracing its
decomposition, several times slower than the rules autograd's decomposition reaches.
These run on a gloo group of one rank in this process: DTensor takes the same path.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor.parallel import ColwiseParallel

from components.tensor_parallel import split_layers
from tests.ranks import joined

Modes = tuple[bool, bool]
"""Whether inference mode and autograd were on."""


class Recording(nn.Linear):
    """A linear layer that records the modes its computation ran in."""

    def __init__(self) -> None:
        super().__init__(8, 16)
        self.modes: list[Modes] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Record the modes, then compute as ``nn.Linear``."""
        self.modes.append((torch.is_inference_mode_enabled(), torch.is_grad_enabled()))
        out: torch.Tensor = super().forward(x)
        return out


@pytest.fixture
def mesh(tmp_path: Path) -> Iterator[DeviceMesh]:
    """A one-rank ``tp`` mesh on a gloo group this process joins, left at the end."""
    with joined(0, 1, str(tmp_path / "rendezvous")):
        yield init_device_mesh("cpu", (1,), mesh_dim_names=("tp",))


def split_copy(whole: Recording, mesh: DeviceMesh) -> tuple[nn.Sequential, Recording]:
    """Return a module holding a copy of ``whole`` split column-wise, and that copy."""
    module = nn.Sequential(copy.deepcopy(whole))
    split_layers(module, mesh, {"0": ColwiseParallel()})
    layer = module[0]
    assert isinstance(layer, Recording)
    return module, layer


class TestSplitLayers:
    """``split_layers``: DTensor shards whose computation leaves inference mode."""

    def test_under_inference_mode_the_layer_computes_without_it(self, mesh: DeviceMesh) -> None:
        """Under inference mode a split layer computes without it and without autograd."""
        torch.manual_seed(0)
        whole = Recording()
        module, split = split_copy(whole, mesh)
        x = torch.randn(3, 8)
        with torch.inference_mode():
            got, want = module(x), whole(x)
        assert split.modes == [(False, False)]
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)

    def test_otherwise_the_layer_computes_in_the_callers_modes(self, mesh: DeviceMesh) -> None:
        """Outside inference mode a split layer computes with autograd as its caller set it."""
        module, split = split_copy(Recording(), mesh)
        module(torch.randn(3, 8))
        with torch.no_grad():
            module(torch.randn(3, 8))
        assert split.modes == [(False, True), (False, False)]

    def test_a_copy_computes_with_its_own_weights(self, mesh: DeviceMesh) -> None:
        """A deep copy of a split module runs its own layer, not the original's."""
        module, split = split_copy(Recording(), mesh)
        copied = copy.deepcopy(module)
        with torch.inference_mode():
            copied(torch.randn(3, 8))
        assert split.modes == []
        assert copied[0].modes == [(False, False)]
