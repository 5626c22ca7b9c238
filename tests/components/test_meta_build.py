"""Building a module empty (``build_empty``, ``SiteLayer``): no initialiser runs on ``meta``,
and attention layers are built apart from the module around them."""

from __future__ import annotations

import copy
import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from attention import Attention, AttentionRole, ComponentRequests, component_attention_scope
from attention.testing import explicit
from components.folders.meta import build_empty
from components.sites import AttentionSite, SiteLayer, build_layers

SAMPLERS = ("uniform_", "normal_")
"""The in-place samplers that initialisers call: on a meta tensor torch runs their Python
reference implementation, the cost the build skips."""


class MetaOps(TorchDispatchMode):
    """Record the name of every aten operation that takes a meta tensor."""

    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if any(isinstance(arg, torch.Tensor) and arg.is_meta for arg in args):
            self.names.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


def layers() -> nn.Module:
    """Build the layers whose initialisers sample: Linear, Embedding, Conv2d, LayerNorm."""
    return nn.Sequential(nn.Linear(4, 8), nn.Embedding(10, 8), nn.Conv2d(2, 4, 3), nn.LayerNorm(8))


def build_beside(work: Callable[[], object]) -> nn.Module:
    """Build ``layers`` empty while another thread runs ``work``, from inside the build;
    return the module once ``work`` is done."""
    inside, done = threading.Event(), threading.Event()

    def other() -> None:
        inside.wait(timeout=30)
        work()
        done.set()

    def factory() -> nn.Module:
        inside.set()
        done.wait(timeout=30)
        return layers()

    thread = threading.Thread(target=other)
    thread.start()
    module = build_empty(factory)
    thread.join(timeout=30)
    assert done.is_set()
    return module


class TestBuildEmpty:
    def test_no_initialiser_samples_into_a_meta_parameter(self) -> None:
        """The parameters are meta tensors and no sampler ran on one, where the same layers
        built plainly on meta run both samplers."""
        with MetaOps() as plain, torch.device("meta"):
            layers()
        with MetaOps() as empty:
            module = build_empty(layers)
        assert set(SAMPLERS) <= set(plain.names)
        assert all(parameter.is_meta for parameter in module.parameters())
        assert [name for name in empty.names if name in SAMPLERS] == []

    def test_a_real_tensor_is_initialised_as_usual(self) -> None:
        """A real tensor an initialiser fills during the build is filled, meta or not around it."""
        real = torch.zeros(64)

        def factory() -> nn.Module:
            nn.init.normal_(real)
            return layers()

        build_empty(factory)
        assert real.abs().sum() > 0

    def test_torch_init_is_left_as_it_is(self) -> None:
        """Nothing is patched: ``torch.nn.init`` holds the same functions during a build, so a
        library imported meanwhile keeps the real ones."""
        before = {name: getattr(nn.init, name) for name in dir(nn.init)}
        during: dict[str, object] = {}

        def factory() -> nn.Module:
            during.update({name: getattr(nn.init, name) for name in dir(nn.init)})
            return layers()

        build_empty(factory)
        assert during.keys() == before.keys()
        assert all(during[name] is found for name, found in before.items())

    def test_another_threads_initialisers_run(self) -> None:
        """While one thread builds empty, another thread's initialisers fill its tensors."""
        other = torch.zeros(64)
        build_beside(lambda: nn.init.normal_(other))
        assert other.abs().sum() > 0

    def test_another_threads_parameters_stay_real(self) -> None:
        """While one thread builds empty, a module another thread constructs keeps its
        parameters on the CPU, with the values its initialisers drew."""
        built: list[nn.Module] = []
        module = build_beside(lambda: built.append(layers()))
        assert {p.device.type for p in built[0].parameters()} == {"cpu"}
        assert all(p.abs().sum() > 0 for p in built[0][0].parameters())
        assert {p.device.type for p in module.parameters()} == {"meta"}

    def test_parameters_are_plain_once_built(self) -> None:
        """Every parameter of an empty build is a plain ``nn.Parameter``, tied ones still one
        object, cloned ones too, a tensor made from one is a plain tensor, and a random fill
        after the build runs as on any parameter."""

        def tied() -> nn.Module:
            module = layers()
            module.append(copy.deepcopy(module[0]))  # a layer cloned, as some libraries do
            module.append(nn.Linear(8, 10, bias=False))
            module[-1].weight = module[1].weight  # the embedding's, as a tied head
            nn.init.normal_(module[-1].weight)  # a library's init after tying
            module.register_buffer("ones", module[0].weight.new_ones(2))  # made from a parameter
            return module

        module = build_empty(tied)
        assert {type(p) for p in module.parameters()} == {nn.Parameter}
        assert type(module.ones) is torch.Tensor
        assert module[-1].weight is module[1].weight
        assert module[-2].weight.is_meta
        assert module[-2].weight is not module[0].weight
        with MetaOps() as after:
            nn.init.normal_(module[0].weight)
        assert "normal_" in after.names


SITE = AttentionSite(name="self", role=AttentionRole.SELF, heads=2)


class TestSiteLayer:
    def test_a_module_built_for_its_declaration_does_not_run(self) -> None:
        """Until its layer is built, a holder refuses to run, naming its site."""
        with pytest.raises(RuntimeError, match="the 'self' attention layer was never built"):
            SiteLayer(SITE).layer  # noqa: B018  (the access is what refuses)

    def test_layers_are_built_in_the_current_scope(self) -> None:
        """``build_layers`` builds every holder's layer once, taking the scope's backend."""
        module = nn.ModuleList([SiteLayer(SITE), nn.ModuleList([SiteLayer(SITE, scale=1.0)])])
        requests = ComponentRequests(component="c", component_backend=explicit("reference"))
        with component_attention_scope(requests):
            build_layers(module)
        holders = [m for m in module.modules() if isinstance(m, SiteLayer)]
        assert [type(h.layer) for h in holders] == [Attention, Attention]
        assert [(h.layer.backend_name, h.layer.scale) for h in holders] == [
            ("reference", None),
            ("reference", 1.0),
        ]
        built = [h.layer for h in holders]
        build_layers(module)
        assert [h.layer for h in holders] == built
