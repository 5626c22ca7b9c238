"""Building a model on meta (``build_empty``, ``build_on_meta``): nothing is initialised."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from components.folders.meta import build_empty, build_on_meta


class MetaOps(TorchDispatchMode):
    """Record the name of every aten operation that takes a meta tensor."""

    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if any(isinstance(arg, torch.Tensor) and arg.is_meta for arg in args):
            self.names.append(func.__name__)
        return func(*args, **(kwargs or {}))


class TestMetaBuilds:
    @pytest.mark.parametrize("build", [build_empty, build_on_meta], ids=lambda b: b.__name__)
    def test_no_initialiser_runs_on_a_meta_parameter(
        self, build: Callable[[Callable[[], nn.Module]], nn.Module]
    ) -> None:
        """Linear, Embedding and LayerNorm are built without filling a meta parameter, while a
        real tensor initialised meanwhile (another thread's build) is filled as usual, and
        ``torch.nn.init`` is as before afterwards."""
        before = {name: getattr(nn.init, name) for name in ("kaiming_uniform_", "normal_", "ones_")}
        real = torch.zeros(64)

        def factory() -> nn.Module:
            nn.init.normal_(real)
            return nn.Sequential(nn.Linear(4, 8), nn.Embedding(10, 8), nn.LayerNorm(8))

        ops = MetaOps()
        with ops:
            module = build(factory)
        assert all(parameter.is_meta for parameter in module.parameters())
        assert [name for name in ops.names if name.endswith("_.default")] == []
        assert real.abs().sum() > 0
        assert all(getattr(nn.init, name) is found for name, found in before.items())

    def test_a_build_inside_a_meta_device_build_runs(self) -> None:
        """``build_empty`` inside ``build_on_meta`` (admission probing a folder kind) builds."""
        module = build_on_meta(lambda: build_empty(lambda: nn.Linear(4, 8)))
        assert isinstance(module, nn.Linear)
        assert module.weight.is_meta
