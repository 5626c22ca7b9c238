"""component_attention_scope: design §4.3 — records, summary, consumption check, plan."""

from __future__ import annotations

import threading
from collections.abc import MutableMapping
from typing import Any

import pytest
import torch
from structlog.testing import capture_logs

from attention import (
    Attention,
    AttentionRequirements,
    AttentionRole,
    BackendSelectionError,
    ComponentRequests,
    PlannedSelection,
    Platform,
    Provenance,
    Selection,
    component_attention_scope,
    current_scope,
    registry,
)
from attention.backends import SlidingWindowOptions
from attention.testing import TOLERANCE, RandomInputs, automatic, explicit, rel_err

SELF, CROSS = AttentionRole.SELF, AttentionRole.CROSS


def scope_at_log_time(_: Any, __: str, event: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
    """A structlog processor that notes whether a scope was active when the event was logged."""
    event["scope_active"] = current_scope() is not None
    return event


def build_self_and_coded_cross() -> None:
    """Build a free self layer and a cross layer whose code names torch_sdpa."""
    Attention("self", SELF)
    Attention("cross", CROSS, backend="torch_sdpa")


class TestComponentAttentionScope:
    """What a component's attention scope records, logs and refuses."""

    def test_records_every_selection_for_after_exit(self, cpu: Platform) -> None:
        """The scope's records list each layer's site, role, source and selection."""
        with component_attention_scope(ComponentRequests(component="vae"), platform=cpu) as scope:
            Attention("mid", SELF)
            Attention("mid", SELF, requirements=AttentionRequirements(packed_varlen=True))
        assert current_scope() is None
        assert [(r.site, r.role, r.source.value, r.selection.backend) for r in scope.records] == [
            ("mid", SELF, "none", "torch_sdpa"),
            ("mid", SELF, "none", "torch_flash"),
        ]

    def test_summary_line_lists_backends_with_reasons(self, cpu: Platform) -> None:
        """One attention.summary event lists each backend once, with its fallback reason."""
        with (
            capture_logs() as logs,
            component_attention_scope(ComponentRequests(component="vae"), platform=cpu),
        ):
            Attention("mid", SELF)
            Attention("mid", SELF, requirements=AttentionRequirements(packed_varlen=True))
            Attention("mid", SELF)
        summaries = [e for e in logs if e["event"] == "attention.summary"]
        assert summaries == [
            {
                "event": "attention.summary",
                "log_level": "info",
                "component": "vae",
                "layers": 3,
                "backends": ["torch_sdpa", "torch_flash (platform default fallback)"],
                "summary": "attention backends for vae: torch_sdpa, "
                "torch_flash (platform default fallback)",
            }
        ]

    def test_unconsumed_backend_raises_after_reset_and_summary(self, cpu: Platform) -> None:
        """An explicit backend with no layer built raises after the scope reset and summary."""
        with (
            capture_logs(processors=[scope_at_log_time]) as logs,
            pytest.raises(BackendSelectionError) as err,
            component_attention_scope(
                ComponentRequests(component="vae", component_backend=explicit("torch_flash")),
                platform=cpu,
            ),
        ):
            pass
        assert err.value.code == "attention.backend_not_consumed"
        assert err.value.component == "vae"
        assert err.value.message == (
            "backend 'torch_flash' was requested for component 'vae', but that component "
            "constructed no attention layers"
        )
        assert err.value.hint == (
            "remove the attention backend requested for component 'vae': nothing in it can use one"
        )
        assert [(e["event"], e["scope_active"]) for e in logs] == [("attention.summary", False)]
        assert current_scope() is None

    def test_role_override_for_a_role_never_built(self, cpu: Platform) -> None:
        """A per-role override for a role the component never builds is not consumed."""
        with (
            pytest.raises(BackendSelectionError) as err,
            component_attention_scope(
                ComponentRequests(component="vae", role_backends={CROSS: explicit("torch_flash")}),
                platform=cpu,
            ),
        ):
            Attention("mid", SELF)
        assert err.value.code == "attention.backend_not_consumed"
        assert err.value.message == (
            "backend 'torch_flash' was requested for the cross-attention layers of component "
            "'vae', but that component constructed no cross-attention layers (only self)"
        )

    def test_component_backend_shadowed_by_every_role(self, cpu: Platform) -> None:
        """A component-wide backend that per-role overrides replace everywhere is unused."""
        with (
            pytest.raises(BackendSelectionError) as err,
            component_attention_scope(
                ComponentRequests(
                    component="transformer",
                    component_backend=explicit("reference"),
                    role_backends={SELF: explicit("torch_sdpa"), CROSS: explicit("torch_sdpa")},
                ),
                platform=cpu,
            ),
        ):
            Attention("self", SELF)
        assert err.value.message == (
            "backend 'reference' was requested for component 'transformer', but per-role "
            "overrides replace it for every role; backend 'torch_sdpa' was requested for the "
            "cross-attention layers of component 'transformer', but that component constructed "
            "no cross-attention layers (only self)"
        )

    def test_error_inside_propagates_unchanged(self, cpu: Platform) -> None:
        """A load error inside passes through as is, with no scope left and no check run."""
        boom = OSError("weights unreadable")
        with (
            pytest.raises(OSError, match="weights unreadable") as err,
            component_attention_scope(
                ComponentRequests(component="vae", component_backend=explicit("torch_flash")),
                platform=cpu,
            ),
        ):
            raise boom
        assert err.value is boom
        assert current_scope() is None

    def test_selection_error_inside_leaves_no_scope(self, cpu: Platform) -> None:
        """A layer whose selection fails raises its own error and the scope is gone after."""
        with (
            pytest.raises(BackendSelectionError) as err,
            component_attention_scope(
                ComponentRequests(
                    component="transformer", component_backend=explicit("torch_sdpa")
                ),
                platform=cpu,
            ),
        ):
            Attention("self", SELF, requirements=AttentionRequirements(packed_varlen=True))
        assert err.value.code == "attention.capability_missing"
        assert current_scope() is None

    def test_automatic_backend_is_exempt(self, cpu: Platform) -> None:
        """An automatic component backend with no layer built is no error."""
        with component_attention_scope(
            ComponentRequests(component="upsampler", component_backend=automatic("torch_flash")),
            platform=cpu,
        ) as scope:
            pass
        assert scope.records == ()

    def test_global_backend_is_not_checked(self, cpu: Platform) -> None:
        """An explicit global backend that no layer used blocks nothing."""
        with component_attention_scope(
            ComponentRequests(component="upsampler", global_backend=explicit("torch_flash")),
            platform=cpu,
        ) as scope:
            pass
        assert scope.records == ()
        assert current_scope() is None

    def test_unexplained_second_backend_is_rejected(self, cpu: Platform) -> None:
        """A layer whose code names another backend than the explicit component one fails."""
        with (
            pytest.raises(BackendSelectionError) as err,
            component_attention_scope(
                ComponentRequests(
                    component="transformer", component_backend=explicit("torch_flash")
                ),
                platform=cpu,
            ),
        ):
            build_self_and_coded_cross()
        assert err.value.code == "attention.backend_not_consumed"
        assert err.value.message == (
            "backend 'torch_flash' was requested for component 'transformer', but layer "
            "'cross' (cross) chose 'torch_sdpa' without an allowed fallback (its request came "
            "from the layer level)"
        )

    def test_reasoned_fallback_is_tolerated(self, cpu: Platform) -> None:
        """A sparse role override that became dense on cross-attention counts as consumed."""
        with component_attention_scope(
            ComponentRequests(
                component="transformer", component_backend=explicit("sliding_window")
            ),
            platform=cpu,
        ) as scope:
            Attention("self", SELF)
            Attention("cross", CROSS)
        assert [(r.selection.backend, r.selection.reason) for r in scope.records] == [
            ("sliding_window", None),
            ("torch_sdpa", "dense cross-attention fallback"),
        ]

    def test_role_override_beats_component_wide_in_scope(self, cpu: Platform) -> None:
        """Layers of the overridden role take the role backend, the others the component one."""
        with component_attention_scope(
            ComponentRequests(
                component="transformer",
                component_backend=explicit("reference"),
                role_backends={CROSS: explicit("torch_flash")},
            ),
            platform=cpu,
        ) as scope:
            Attention("self", SELF)
            Attention("cross", CROSS)
        assert [(r.source.value, r.selection.backend) for r in scope.records] == [
            ("component", "reference"),
            ("role", "torch_flash"),
        ]

    def test_nested_scopes_restore_the_outer_one(self, cpu: Platform) -> None:
        """A scope inside another applies to its own layers and restores the outer on exit."""
        with component_attention_scope(ComponentRequests(component="outer"), platform=cpu) as outer:
            with component_attention_scope(
                ComponentRequests(component="inner"), platform=cpu
            ) as inner:
                assert current_scope() is inner
                Attention("a", SELF)
            assert current_scope() is outer
            Attention("b", SELF)
        assert [r.site for r in inner.records] == ["a"]
        assert [r.site for r in outer.records] == ["b"]

    def test_scope_is_not_visible_from_another_thread(self, cpu: Platform) -> None:
        """The scope is context-local: a thread started inside it sees none."""
        seen: list[object] = []
        with component_attention_scope(ComponentRequests(component="vae"), platform=cpu):
            thread = threading.Thread(target=lambda: seen.append(current_scope()))
            thread.start()
            thread.join()
        assert seen == [None]

    def test_plan_is_followed_without_selecting_again(self, cpu: Platform) -> None:
        """A layer built as its planned site takes the planned Selection object itself."""
        requests = ComponentRequests(component="transformer")
        planned = PlannedSelection(
            request=requests.for_site("self", SELF, default="torch_flash"),
            # not what select_backend would choose: only the plan can hand this out
            selection=Selection(backend="reference", reason=None, provenance=Provenance.DEFAULT),
        )
        with component_attention_scope(requests, platform=cpu, plan={"self": planned}):
            layer = Attention("self", SELF, default="torch_flash")
        assert layer.backend_name == "reference"
        assert layer.selection is planned.selection

    def test_plan_divergence_fails(self, cpu: Platform) -> None:
        """A layer unlike the site its plan was made from raises plan_diverged, naming why."""
        requests = ComponentRequests(component="transformer")
        planned = PlannedSelection(
            request=requests.for_site("self", SELF, default="torch_flash"),
            selection=Selection(backend="torch_flash", reason=None, provenance=Provenance.DEFAULT),
        )
        with (
            pytest.raises(BackendSelectionError) as err,
            component_attention_scope(requests, platform=cpu, plan={"self": planned}),
        ):
            Attention("self", SELF)
        assert err.value.code == "attention.plan_diverged"
        assert err.value.message == (
            "layer 'self' (self) of component 'transformer' differs from the site the plan "
            "was made from: layer_default None (planned 'torch_flash')"
        )

    def test_undeclared_site_fails_under_a_plan(self, cpu: Platform) -> None:
        """A layer for a site the plan does not know raises plan_diverged."""
        requests = ComponentRequests(component="transformer")
        planned = PlannedSelection(
            request=requests.for_site("self", SELF),
            selection=Selection(backend="torch_sdpa", reason=None, provenance=Provenance.DEFAULT),
        )
        with (
            pytest.raises(
                BackendSelectionError, match=r"not in the admitted plan \(planned sites: self\)"
            ),
            component_attention_scope(requests, platform=cpu, plan={"self": planned}),
        ):
            Attention("cross", CROSS)

    def test_backend_options_reach_the_kernel(self, cpu: Platform, inputs: RandomInputs) -> None:
        """The scope's options for a backend configure that backend's kernels."""
        with component_attention_scope(
            ComponentRequests(
                component="transformer",
                component_backend=explicit("sliding_window"),
                backend_options={"sliding_window": SlidingWindowOptions(window=3)},
            ),
            platform=cpu,
        ):
            layer = Attention("self", SELF)
        layer.arm()
        q, k, v = inputs.qkv(1, 2, 2, 20, 20, 8, dtype=torch.float64)
        near = (torch.arange(20)[:, None] - torch.arange(20)[None, :]).abs() <= 3
        ref = registry.get("reference").make_impl()
        expected = ref.forward_masked(q, k, v, near, scale=None)
        assert rel_err(layer(q, k, v), expected) < TOLERANCE[torch.float64], f"seed {inputs.seed}"

    def test_ring_applies_to_self_attention_only(self, cpu: Platform) -> None:
        """With ring attention, self layers need softmax LSE and cross layers do not."""
        with component_attention_scope(
            ComponentRequests(component="transformer", ring=True), platform=cpu
        ) as scope:
            Attention("self", SELF)
            Attention("cross", CROSS)
        assert [r.selection.backend for r in scope.records] == ["torch_flash", "torch_sdpa"]

    def test_logs_one_selected_event_per_layer(self, cpu: Platform) -> None:
        """Each layer logs attention.selected with component, site, role, backend, reason."""
        with (
            capture_logs() as logs,
            component_attention_scope(
                ComponentRequests(
                    component="transformer", role_backends={CROSS: explicit("sliding_window")}
                ),
                platform=cpu,
            ),
        ):
            Attention("cross", CROSS)
        assert logs[0] == {
            "event": "attention.selected",
            "log_level": "info",
            "component": "transformer",
            "site": "cross",
            "role": "cross",
            "backend": "torch_sdpa",
            "provenance": "explicit",
            "reason": "dense cross-attention fallback",
        }
