"""Layers split by tensor parallel compute on their shards (a linear) or outside inference
mode (any other layer), equal to the whole layer.

DTensor derives the sharding of each operation on a ``DTensor`` for every new input shape,
and under inference mode by tracing ``linear``'s decomposition, several times slower.
These run on a gloo group of one rank in this process: DTensor takes the same path.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from components.tensor_parallel import split_layers
from tests.ranks import joined

# torch.distributed.tensor is imported where a test uses it, not at collection: importing it
# costs 1.1 CPU-s, which every xdist worker paid collecting this file and one of them runs.
if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

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
    from torch.distributed.device_mesh import init_device_mesh

    with joined(0, 1, str(tmp_path / "rendezvous")):
        yield init_device_mesh("cpu", (1,), mesh_dim_names=("tp",))


class DTensorOperations(TorchDispatchMode):
    """Record every operation dispatched on a ``DTensor`` (each derives its sharding)."""

    def __init__(self) -> None:
        from torch.distributed.tensor import DTensor

        super().__init__()
        self.names: list[str] = []
        self.dtensor = DTensor

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        """Record ``func`` if a DTensor takes part, then run it."""
        if any(issubclass(kind, self.dtensor) for kind in types):
            self.names.append(str(func))
        return func(*args, **(kwargs or {}))


def split_copy(whole: Recording, mesh: DeviceMesh) -> tuple[nn.Sequential, Recording]:
    """Return a module holding a copy of ``whole`` split column-wise, and that copy."""
    from torch.distributed.tensor.parallel import ColwiseParallel

    module = nn.Sequential(copy.deepcopy(whole))
    split_layers(module, mesh, {"0": ColwiseParallel()})
    layer = module[0]
    assert isinstance(layer, Recording)
    return module, layer


class TestSplitLayers:
    """``split_layers``: DTensor shards whose computation leaves inference mode, or runs on
    the local shards."""

    def test_splitting_sends_nothing(self, mesh: DeviceMesh) -> None:
        """Each rank cuts its shards from its own copy of the weights (every rank loads the
        same files): no weight is scattered or broadcast from the first rank."""
        from torch.distributed.tensor import DTensor
        from torch.distributed.tensor.debug import CommDebugMode
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

        module = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8))
        with CommDebugMode() as sent:
            split_layers(module, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
        assert isinstance(module[2].bias, DTensor)
        assert sent.get_comm_counts() == {}

    @pytest.mark.parametrize("inference", [True, False])
    def test_a_linear_computes_on_its_shards(self, mesh: DeviceMesh, inference: bool) -> None:
        """Split column- then row-wise, two linears equal the whole ones, and no operation
        reaches DTensor (which would derive its sharding for each new input shape)."""
        from torch.distributed.tensor import DTensor
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

        torch.manual_seed(0)
        whole = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8))
        module = copy.deepcopy(whole)
        split_layers(module, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
        assert isinstance(module[0].weight, DTensor)  # the weights stay DTensor shards
        x = torch.randn(2, 3, 8)
        with torch.inference_mode(inference), DTensorOperations() as operations:
            got = module(x)
        assert operations.names == []
        torch.testing.assert_close(got, whole(x), rtol=1e-6, atol=1e-6)

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
