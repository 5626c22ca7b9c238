"""Loading along the admitted plan: one decision, made at admission, carried out at load."""

from __future__ import annotations

from collections.abc import Iterator
from typing import ClassVar

import pytest
from torch import nn

from attention import Attention, AttentionRole, Platform, SelectionCode
from components import registry as kinds
from components.loader import ComponentLoader
from components.sites import AttentionSite
from lifecycle.admission import admit_pipeline
from lifecycle.machines.tables import ComponentState
from lifecycle.orchestrator import Orchestrator
from lifecycle.refusals import AdmissionRefused, RefusalCode, TransitionFailed
from lifecycle.spec.reading import decode_spec
from lifecycle.testing import capture_events, events_named
from tests.lifecycle.kinds_for_tests import SelfAttentionNet

SELF = AttentionRole.SELF
DECLARED = AttentionSite(name="self", role=AttentionRole.SELF, heads=2, default="torch_flash")


class DivergentSiteKind(ComponentLoader):
    """A kind that declares site ``self`` with a default but builds it without one."""

    kind: ClassVar[str] = "test_divergent_site"

    def sites(self) -> tuple[AttentionSite, ...]:
        """Declare site self, defaulting to torch_flash."""
        return (DECLARED,)

    def build_custom(self) -> nn.Module:
        """Build site self without the declared default."""
        return SelfAttentionNet(AttentionSite(name="self", role=AttentionRole.SELF, heads=2))


class MissingSiteKind(ComponentLoader):
    """A kind that declares site ``self`` but builds no attention layer."""

    kind: ClassVar[str] = "test_missing_site"

    def sites(self) -> tuple[AttentionSite, ...]:
        """Declare site self."""
        return (DECLARED,)

    def build_custom(self) -> nn.Module:
        """Build a module with no attention layer at all."""
        return SelfAttentionNet(None)


@pytest.fixture(autouse=True)
def test_kinds() -> Iterator[None]:
    """Register this file's kinds for one test, then forget them."""
    for kind in (DivergentSiteKind, MissingSiteKind):
        kinds.register_kind(kind)
    yield
    for kind in (DivergentSiteKind, MissingSiteKind):
        kinds.unregister_kind(kind.kind)


def one_component(kind: str, extra: str = "") -> str:
    """Return a spec with one component ``c`` of ``kind``, used by one stage."""
    stage = '[[stages]]\nname = "s"\nuses = ["c"]\n'
    return f'name = "p"\n[components.c]\nkind = "{kind}"\n{extra}\n{stage}'


class TestLoadAlongThePlan:
    def test_layer_unlike_its_declared_site_fails_the_load(self, cpu: Platform) -> None:
        """A layer built unlike the site admission planned fails load with plan_diverged."""
        orch = Orchestrator(decode_spec(one_component("test_divergent_site")), platform=cpu)
        orch.admit()
        with pytest.raises(TransitionFailed) as err:
            orch.load()
        cause = err.value.__cause__
        assert getattr(cause, "code", None) is SelectionCode.PLAN_DIVERGED
        assert "layer_default None (planned 'torch_flash')" in str(cause)
        assert orch.state("c") is ComponentState.ADMITTED

    def test_declared_site_never_built_breaches_the_postcondition(self, cpu: Platform) -> None:
        """A declared site the loader never builds breaches plan_honoured, rolled back."""
        orch = Orchestrator(decode_spec(one_component("test_missing_site")), platform=cpu)
        orch.admit()
        with pytest.raises(TransitionFailed) as err:
            orch.load()
        assert getattr(err.value.__cause__, "codes", None) == (RefusalCode.PLAN_DIVERGED,)
        assert orch.state("c") is ComponentState.ADMITTED

    def test_layers_take_the_planned_selection(self, cpu: Platform) -> None:
        """Every layer of a planned component runs the backend admission planned for its site."""
        orch = Orchestrator(decode_spec(one_component("tiny_dit")), platform=cpu)
        orch.admit()
        orch.load()
        plan = orch.component("c").plan
        assert plan is not None
        planned = {site.site: site.backend for site in plan.attention}
        built = [m for m in orch.module("c").modules() if isinstance(m, Attention)]
        assert {layer.site for layer in built} == set(planned)
        assert all(layer.backend_name == planned[layer.site] for layer in built)


class TestAdmissionRecords:
    def test_requests_are_made_once_and_carry_decoded_options(self, cpu: Platform) -> None:
        """A component's requests hold the backend options decoded once, as a Struct."""
        spec = decode_spec(
            one_component(
                "tiny_dit",
                'attention_backend = { self = "sliding_window" }\n'
                "options = { packed_sequences = false }",
            )
            + "[attention.backend_options.sliding_window]\nwindow = 8\n"
        )
        admitted = admit_pipeline(spec, cpu).components["c"]
        options = admitted.requests.backend_options["sliding_window"]
        assert getattr(options, "window", None) == 8
        assert admitted.planned is not None
        assert admitted.planned["self"].request == admitted.requests.for_site("self", SELF)
        assert admitted.planned["self"].selection.backend == "sliding_window"

    def test_refused_admission_logs_one_event_per_component(self, cpu: Platform) -> None:
        """lifecycle.refused names each refused component, each with its own codes."""
        spec = decode_spec(
            'name = "p"\n[components.vae]\nkind = "tiny_vae"\nattention_backend = "reference"\n'
            '[components.up]\nkind = "tiny_upsampler"\nattention_backend = "torch_sdpa"\n'
        )
        with capture_events() as events, pytest.raises(AdmissionRefused):
            Orchestrator(spec, platform=cpu).admit()
        refused = {e["component"]: e["codes"] for e in events_named(events, "lifecycle.refused")}
        assert refused == {
            "vae": ["attention.unsupported_backend"],
            "up": ["attention.backend_not_consumed"],
        }
