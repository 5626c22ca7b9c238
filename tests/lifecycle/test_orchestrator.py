"""The orchestrator: admission all-or-nothing, loading along the plan, snapshots."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Callable, Iterator

import msgspec
import pytest
import torch

from attention import Attention, NotResidentError, Platform
from components import registry as kinds
from components.loader import ComponentLoader, PathUnavailable
from lifecycle.machines.tables import ComponentState
from lifecycle.orchestrator import Orchestrator
from lifecycle.refusals import (
    AdmissionRefused,
    InvalidTransition,
    TransitionFailed,
    TransitionRefused,
)
from lifecycle.spec.reading import decode_spec
from lifecycle.testing import capture_events, events_named
from tests.lifecycle.kinds_for_tests import (
    BrokenKind,
    GenericKind,
    NativeOnlyKind,
    PlainGenericKind,
    UndeclaredSiteKind,
)

TEST_KINDS: tuple[type[ComponentLoader], ...] = (
    NativeOnlyKind,
    BrokenKind,
    UndeclaredSiteKind,
    GenericKind,
    PlainGenericKind,
)


@pytest.fixture(autouse=True)
def test_kinds() -> Iterator[None]:
    """Register the test kinds for one test, then forget them."""
    for kind in TEST_KINDS:
        kinds.register_kind(kind)
    NativeOnlyKind.native_builds.clear()
    BrokenKind.allocated.clear()
    yield
    for kind in TEST_KINDS:
        kinds.unregister_kind(kind.kind)


@pytest.fixture
def orchestrator(cpu: Platform) -> Callable[[str], Orchestrator]:
    """Make an orchestrator for a TOML spec text on the CPU platform."""
    return lambda text: Orchestrator(decode_spec(text), platform=cpu)


def one_component(kind: str, extra: str = "") -> str:
    """Return a spec with one component ``c`` of ``kind``, used by one stage."""
    return f"""
name = "p"
[components.c]
kind = "{kind}"
{extra}
[[stages]]
name = "s"
uses = ["c"]
"""


class TestReferencePipeline:
    def test_load_places_every_component(self, reference_orchestrator: Orchestrator) -> None:
        """load() leaves resident components RESIDENT and offloaded ones OFFLOADED."""
        with reference_orchestrator as orch:
            orch.load()
            assert orch.state("transformer") is ComponentState.RESIDENT
            assert orch.state("text_encoder") is ComponentState.OFFLOADED
            assert orch.state("vae") is ComponentState.OFFLOADED
        assert orch.state("vae") is ComponentState.RELEASED

    def test_attention_runs_only_while_resident(self, reference_orchestrator: Orchestrator) -> None:
        """An offloaded component's layers refuse to run; after onload they run."""
        with reference_orchestrator as orch:
            orch.load()
            vae = orch.module("vae")
            layer = next(m for m in vae.modules() if isinstance(m, Attention))
            (site,) = kinds.get("tiny_vae").from_options({}).sites() or ()
            q = torch.randn(1, site.heads, 4, 8)
            with pytest.raises(NotResidentError, match="component 'vae'"):
                layer(q, q, q)
            orch.onload("vae")
            assert torch.isfinite(layer(q, q, q)).all()
            assert orch.module("vae") is vae

    def test_transitions_are_logged(self, reference_orchestrator: Orchestrator) -> None:
        """Every transition of load() is one lifecycle.transition event; moves are logged."""
        with (
            capture_events() as events,
            reference_orchestrator as orch,
        ):
            orch.load()
        triples = [
            (e["component"], e["trigger"], e["dest"])
            for e in events_named(events, "lifecycle.transition")
        ]
        assert ("vae", "offload", "offloaded") in triples
        assert ("transformer", "onload", "resident") in triples
        moved = events_named(events, "residency.moved")
        assert {(e["component"], e["direction"]) for e in moved} == {
            ("text_encoder", "offload"),
            ("transformer", "onload"),
            ("vae", "offload"),
        }
        assert all(e["bytes"] > 0 and e["request_id"] is None for e in moved)

    def test_snapshot_encodes_to_json(self, reference_orchestrator: Orchestrator) -> None:
        """The snapshot names each component's state, loader and backends as JSON."""
        with reference_orchestrator as orch:
            orch.load()
            data = msgspec.json.decode(msgspec.json.encode(orch.snapshot()))
        assert data["admitted"] is True
        assert data["components"]["vae"]["state"] == "offloaded"
        assert data["components"]["transformer"]["attention"][0]["site"] == "self"


class TestAdmissionIsAllOrNothing:
    def test_refused_pipeline_leaves_everything_configured(
        self, orchestrator: Callable[[str], Orchestrator]
    ) -> None:
        """One refused component keeps every other one CONFIGURED too."""
        orch = orchestrator(
            one_component("tiny_dit")
            + '[components.vae]\nkind = "tiny_vae"\nattention_backend = "reference"\n'
        )
        with pytest.raises(AdmissionRefused) as err:
            orch.admit()
        assert err.value.codes == ("attention.unsupported_backend",)
        assert orch.state("c") is ComponentState.CONFIGURED
        assert orch.state("vae") is ComponentState.CONFIGURED


class TestAdmitThenLoad:
    def test_second_admit_is_invalid_and_changes_nothing(
        self, orchestrator: Callable[[str], Orchestrator]
    ) -> None:
        """Admitting a loaded pipeline again is refused; its plan and states stay."""
        orch = orchestrator(one_component("tiny_vae"))
        orch.load()
        plan = orch.component("c").plan
        with pytest.raises(InvalidTransition):
            orch.admit()
        assert orch.component("c").plan == plan
        assert orch.state("c") is ComponentState.RESIDENT

    def test_load_after_a_refused_admit_refuses_again(
        self, orchestrator: Callable[[str], Orchestrator]
    ) -> None:
        """load() after a refused admission does not pass silently: it is refused again."""
        orch = orchestrator(one_component("tiny_vae", 'attention_backend = "reference"'))
        with pytest.raises(AdmissionRefused):
            orch.admit()
        with pytest.raises(AdmissionRefused):
            orch.load()
        assert orch.state("c") is ComponentState.CONFIGURED

    def test_fsdp_in_a_replica_of_one_rank_is_refused_at_admission(
        self, orchestrator: Callable[[str], Orchestrator]
    ) -> None:
        """FSDP over the DiT with nothing to shard with (one rank) is refused by admission."""
        orch = orchestrator(one_component("tiny_dit") + '[parallel]\nfsdp = ["c"]\n')
        with pytest.raises(AdmissionRefused) as err:
            orch.admit()
        assert err.value.codes == ("parallel.invalid_layout",)
        assert "there is nothing to shard with" in err.value.refusals[0].message
        assert orch.state("c") is ComponentState.CONFIGURED


class TestLoading:
    def test_failing_loader_keeps_admitted_and_retains_nothing(
        self, orchestrator: Callable[[str], Orchestrator]
    ) -> None:
        """A loader that raises leaves the component ADMITTED and frees what it built."""
        orch = orchestrator(one_component("test_broken"))
        orch.admit()
        with pytest.raises(TransitionFailed) as err:
            orch.load()
        assert isinstance(err.value.__cause__, OSError)
        assert orch.state("c") is ComponentState.ADMITTED
        with pytest.raises(LookupError, match="component 'c' has no module"):
            orch.module("c")
        built = weakref.ref(BrokenKind.allocated.pop())
        gc.collect()
        assert built() is None

    @pytest.mark.parametrize(
        "extra",
        ["", 'attention_backend = "torch_sdpa"'],
        ids=["plain", "explicit-backend"],
    )
    def test_path_unavailable_at_load_fails_without_replanning(
        self, orchestrator: Callable[[str], Orchestrator], extra: str
    ) -> None:
        """A custom path found unavailable at load fails the load; native never runs instead."""
        orch = orchestrator(one_component("test_native_only", extra))
        plan = orch.admit().components["c"]
        with pytest.raises(TransitionFailed) as err:
            orch.load()
        assert isinstance(err.value.__cause__, PathUnavailable)
        assert NativeOnlyKind.native_builds == []
        assert orch.state("c") is ComponentState.ADMITTED
        assert orch.component("c").plan == plan
        assert plan.loader == "custom"

    def test_layout_refuses_fsdp_before_any_native_fallback(
        self, orchestrator: Callable[[str], Orchestrator]
    ) -> None:
        """FSDP in one process is refused at admission, so no native fallback ever runs."""
        orch = orchestrator(one_component("test_native_only") + '[parallel]\nfsdp = ["c"]\n')
        with pytest.raises(AdmissionRefused) as err:
            orch.load()
        assert err.value.codes == ("parallel.invalid_layout",)
        assert NativeOnlyKind.native_builds == []
        assert orch.state("c") is ComponentState.CONFIGURED

    def test_layout_refuses_native_fallback_at_admission(
        self, orchestrator: Callable[[str], Orchestrator]
    ) -> None:
        """A kind with only a native path under tensor parallelism is refused at admission."""
        spec = one_component("tiny_text_encoder", 'loader = "native"') + "[parallel]\ntp_size = 2\n"
        with pytest.raises(AdmissionRefused) as err:
            orchestrator(spec).admit()
        assert err.value.codes == ("loader.native_parallel_layout",)

    def test_world_size_must_match_the_launch(
        self, orchestrator: Callable[[str], Orchestrator]
    ) -> None:
        """An admitted layout of 2 processes is refused at load in a single process."""
        orch = orchestrator(one_component("tiny_dit") + "[parallel]\ntp_size = 2\n")
        orch.admit()
        with pytest.raises(TransitionRefused) as err:
            orch.load()
        assert err.value.codes == ("parallel.invalid_layout",)
        assert "needs 2 processes, but 1 was launched" in str(err.value)
        assert orch.state("c") is ComponentState.ADMITTED

    def test_undeclared_site_fails_the_plan_postcondition(
        self, orchestrator: Callable[[str], Orchestrator]
    ) -> None:
        """A layer built for a site the kind never declared fails load with plan_diverged."""
        orch = orchestrator(one_component("test_undeclared_site"))
        orch.admit()
        with pytest.raises(TransitionFailed) as err:
            orch.load()
        assert getattr(err.value.__cause__, "code", None) == "attention.plan_diverged"
        assert orch.state("c") is ComponentState.ADMITTED


class TestGenericLoader:
    def test_factory_kind_loads_strictly(self, orchestrator: Callable[[str], Orchestrator]) -> None:
        """A kind registered as a plain factory builds from it; its layer selects strictly."""
        orch = orchestrator(one_component("test_generic"))
        orch.load()
        layer = next(m for m in orch.module("c").modules() if isinstance(m, Attention))
        assert (layer.component, layer.backend_name) == ("c", "torch_sdpa")

    def test_unconsumed_backend_fails_the_load(
        self, orchestrator: Callable[[str], Orchestrator]
    ) -> None:
        """An explicit cross backend on a generic module with none fails its load, rolled back."""
        orch = orchestrator(
            one_component("test_generic_plain", 'attention_backend = "torch_flash"')
        )
        orch.admit()
        with pytest.raises(TransitionFailed) as err:
            orch.load()
        assert getattr(err.value.__cause__, "code", None) == "attention.backend_not_consumed"
        assert orch.state("c") is ComponentState.ADMITTED

    def test_unknown_kind_is_a_config_error(self) -> None:
        """An unknown kind is refused when the spec is decoded, listing the installed kinds."""
        from lifecycle.spec.errors import ConfigError

        with pytest.raises(ConfigError) as err:
            decode_spec(one_component("my_model"))
        assert err.value.path == "$.components.c.kind"
        assert "tiny_dit" in err.value.message
        assert "'my_model'" in err.value.message

    def test_a_spec_cannot_name_a_factory(self) -> None:
        """``options.factory`` is an unknown option: a spec never names code to import."""
        from lifecycle.spec.errors import ConfigError

        with pytest.raises(ConfigError) as err:
            decode_spec(one_component("test_generic", 'options = { factory = "os:fork" }'))
        assert err.value.path == "$.components.c.options"
        assert "factory" in err.value.message
