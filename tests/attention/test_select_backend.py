"""select_backend: design §4.2 case by case — precedence, fallback, chain, errors, reasons."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from structlog.testing import capture_logs

from attention import (
    AttentionBackend,
    AttentionRequirements,
    AttentionRole,
    BackendChoice,
    BackendRequest,
    BackendSelectionError,
    Platform,
    Provenance,
    Selection,
    register_backend,
    registry,
    select_backend,
)
from attention.packing import PerSegmentVarlen
from attention.testing import SdpaImpl, automatic, explicit

# B batch, H heads, S seq, D head dim, T packed tokens

VARLEN = AttentionRequirements(packed_varlen=True)
SELF, CROSS = AttentionRole.SELF, AttentionRole.CROSS
NO_FLASH = Platform("cpu", unavailable={"torch_flash": "banned in this test"})


def layer(role: AttentionRole = SELF, **fields: object) -> BackendRequest:
    """Return a request for a layer of component 'transformer' with the given fields."""
    site = "self" if role is SELF else "cross"
    return BackendRequest(component="transformer", site=site, role=role, **fields)  # type: ignore[arg-type]


class VarlenImpl(PerSegmentVarlen, SdpaImpl):
    """An out-of-tree dense kernel with packed varlen (per-segment SDPA)."""


class VarlenBackend(AttentionBackend):
    """An out-of-tree dense varlen backend."""

    name = "test_varlen"
    impl_cls = VarlenImpl


class SparseBackend(AttentionBackend):
    """An out-of-tree sparse varlen backend (never a fallback)."""

    name = "test_sparse"
    impl_cls = VarlenImpl
    is_sparse = True


@pytest.fixture
def out_of_tree() -> Iterator[None]:
    """Register a sparse, then a dense out-of-tree varlen backend for one test."""
    register_backend(SparseBackend)
    register_backend(VarlenBackend)
    yield
    registry.unregister_backend(SparseBackend.name)
    registry.unregister_backend(VarlenBackend.name)


def fails(request: BackendRequest, platform: Platform) -> BackendSelectionError:
    """Run a selection that must fail and return its error."""
    with pytest.raises(BackendSelectionError) as err:
        select_backend(request, platform)
    return err.value


class TestSelectBackend:
    """Each selection rule of design §4.2 as its own case."""

    def test_nothing_requested_takes_the_platform_default(self, cpu: Platform) -> None:
        """With no request and no layer default, the platform default is chosen, no reason."""
        assert select_backend(layer(), cpu) == Selection(
            backend="torch_sdpa", reason=None, provenance=Provenance.DEFAULT, rejected={}
        )

    def test_layer_default_beats_the_platform_default(self, cpu: Platform) -> None:
        """With nothing requested the layer default is chosen, and that is no fallback."""
        got = select_backend(layer(layer_default="torch_flash"), cpu)
        assert (got.backend, got.reason, got.provenance) == (
            "torch_flash",
            None,
            Provenance.DEFAULT,
        )

    def test_implicit_platform_preference_falls_back(self, cpu: Platform) -> None:
        """An automatic request the platform cannot run falls back to the platform default."""
        got = select_backend(layer(component_override=automatic("flash_attn")), cpu)
        assert got == Selection(
            backend="torch_sdpa",
            reason="platform default fallback",
            provenance=Provenance.AUTOMATIC,
            rejected={"flash_attn": ("flash_attn needs a CUDA device, this platform is cpu",)},
        )

    def test_implicit_preference_missing_a_capability_falls_back(self, cpu: Platform) -> None:
        """The default preference lacking varlen falls back along the preference list."""
        got = select_backend(layer(requirements=VARLEN), cpu)
        assert got == Selection(
            backend="torch_flash",
            reason="platform default fallback",
            provenance=Provenance.DEFAULT,
            rejected={"torch_sdpa": ("does not implement packed varlen attention",)},
        )

    def test_unavailable_layer_default_falls_back(self) -> None:
        """A layer default the platform cannot run falls back to the platform default."""
        got = select_backend(layer(layer_default="torch_flash"), NO_FLASH)
        assert (got.backend, got.reason) == ("torch_sdpa", "platform default fallback")
        assert got.rejected == {"torch_flash": ("banned in this test",)}

    def test_explicit_global_unsupported_by_strict_layer_fails_closed(self, cpu: Platform) -> None:
        """An explicit global backend outside a strict layer's supported set is refused."""
        request = layer(
            supported=frozenset({"torch_sdpa", "torch_flash"}),
            global_backend=explicit("reference"),
        )
        err = fails(request, cpu)
        assert err.code == "attention.unsupported_backend"
        assert err.component == "transformer"
        assert err.message == (
            "backend 'reference' is not supported by this attention layer (layer 'self' (self) "
            "of component 'transformer'); supported: [torch_flash, torch_sdpa]"
        )
        assert err.hint == "pick one of torch_flash, torch_sdpa for component 'transformer'"
        assert err.rejected == {"reference": ("not in the layer's supported set",)}
        assert "component 'transformer'" in str(err)

    def test_explicit_global_missing_capability_fails_closed(self, cpu: Platform) -> None:
        """An explicit global backend without a required capability is refused, not swapped."""
        err = fails(layer(requirements=VARLEN, global_backend=explicit("torch_sdpa")), cpu)
        assert err.code == "attention.capability_missing"
        assert err.message == (
            "backend 'torch_sdpa' does not implement packed varlen attention, which layer "
            "'self' (self) of component 'transformer' requires"
        )
        assert err.hint == (
            "pick a backend that implements packed varlen attention (torch_flash, reference) "
            "for component 'transformer'"
        )

    def test_explicit_global_falls_back_to_the_layer_default(self, cpu: Platform) -> None:
        """A layer that declares a default lets an explicit global backend fall back to it."""
        request = layer(
            supported=frozenset({"torch_sdpa", "torch_flash"}),
            layer_default="torch_flash",
            global_backend=explicit("sliding_window"),
        )
        got = select_backend(request, cpu)
        assert got == Selection(
            backend="torch_flash",
            reason="global backend fallback",
            provenance=Provenance.EXPLICIT,
            rejected={"sliding_window": ("not in the layer's supported set",)},
        )

    def test_explicit_global_falls_back_where_the_loader_allows(self, cpu: Platform) -> None:
        """A component whose loader allows global fallback takes the platform default."""
        request = layer(
            requirements=AttentionRequirements(attention_mask=True),
            global_backend=explicit("sliding_window"),
            allow_global_fallback=True,
        )
        got = select_backend(request, cpu)
        assert (got.backend, got.reason) == ("torch_sdpa", "global backend fallback")
        assert got.rejected == {"sliding_window": ("does not implement attention masks",)}

    def test_explicit_component_backend_stays_strict(self, cpu: Platform) -> None:
        """A component-wide explicit backend never falls back, default or allowance aside."""
        request = layer(
            requirements=VARLEN,
            layer_default="torch_flash",
            allow_global_fallback=True,
            component_override=explicit("torch_sdpa"),
        )
        err = fails(request, cpu)
        assert err.code == "attention.capability_missing"
        assert err.rejected == {"torch_sdpa": ("does not implement packed varlen attention",)}

    def test_explicit_unavailable_backend_fails_closed(self, cpu: Platform) -> None:
        """An explicit backend the platform cannot run is refused as unavailable."""
        err = fails(layer(component_override=explicit("flash_attn")), cpu)
        assert err.code == "attention.unavailable_backend"
        assert err.message == (
            "backend 'flash_attn' is not available on this cpu platform (flash_attn needs a "
            "CUDA device, this platform is cpu), which layer 'self' (self) of component "
            "'transformer' was asked to use"
        )
        assert err.hint == (
            "pick an available backend (torch_sdpa, torch_flash, reference, sliding_window) "
            "for component 'transformer'"
        )

    def test_sparse_falls_back_to_dense_on_cross_attention(self, cpu: Platform) -> None:
        """An explicit sparse backend on cross-attention becomes the dense platform default."""
        got = select_backend(layer(CROSS, component_override=explicit("sliding_window")), cpu)
        assert got == Selection(
            backend="torch_sdpa",
            reason="dense cross-attention fallback",
            provenance=Provenance.EXPLICIT,
            rejected={"sliding_window": ("sparse, never used for cross-attention",)},
        )

    def test_sparse_falls_back_to_dense_within_the_supported_set(self, cpu: Platform) -> None:
        """With a declared supported set the dense fallback stays inside it."""
        request = layer(
            CROSS,
            supported=frozenset({"sliding_window", "torch_flash"}),
            role_override=explicit("sliding_window"),
        )
        got = select_backend(request, cpu)
        assert (got.backend, got.reason) == ("torch_flash", "dense cross-attention fallback")

    def test_explicit_sparse_is_admitted_for_self_attention(self, cpu: Platform) -> None:
        """An explicit sparse backend serves self-attention, with no reason."""
        got = select_backend(layer(component_override=explicit("sliding_window")), cpu)
        assert (got.backend, got.reason, got.provenance) == (
            "sliding_window",
            None,
            Provenance.EXPLICIT,
        )

    def test_role_override_applies_to_its_role_and_beats_component_wide(
        self, cpu: Platform
    ) -> None:
        """A per-role override wins for its role; other roles take the component-wide one."""
        overrides = {"component_override": explicit("reference")}
        cross = layer(CROSS, role_override=explicit("torch_flash"), **overrides)
        own = layer(SELF, **overrides)  # the scope passes a role override only to its role
        assert select_backend(cross, cpu).backend == "torch_flash"
        assert select_backend(own, cpu).backend == "reference"

    def test_layer_code_beats_every_override(self, cpu: Platform) -> None:
        """A backend named by the layer's code beats role, component and global requests."""
        request = layer(
            layer_backend="reference",
            role_override=explicit("torch_flash"),
            component_override=explicit("torch_flash"),
            global_backend=explicit("torch_flash"),
        )
        got = select_backend(request, cpu)
        assert (got.backend, got.provenance) == ("reference", Provenance.EXPLICIT)

    def test_global_applies_below_component_overrides(self, cpu: Platform) -> None:
        """The global backend applies only where no component override is given."""
        assert select_backend(layer(global_backend=explicit("reference")), cpu).backend == (
            "reference"
        )
        request = layer(
            component_override=explicit("torch_flash"), global_backend=explicit("reference")
        )
        assert select_backend(request, cpu).backend == "torch_flash"

    def test_capability_missing_beats_an_earlier_unsupported(self) -> None:
        """When candidates fail differently, a missing capability is the error reported."""
        request = layer(
            requirements=VARLEN,
            supported=frozenset({"torch_sdpa", "torch_flash"}),
            component_override=automatic("reference"),
        )
        err = fails(request, NO_FLASH)
        assert err.code == "attention.capability_missing"
        assert err.rejected == {
            "reference": ("not in the layer's supported set",),
            "torch_sdpa": ("does not implement packed varlen attention",),
            "torch_flash": ("banned in this test",),
        }

    def test_unsupported_beats_unavailable(self) -> None:
        """Without a capability failure, the first unsupported candidate is reported."""
        request = layer(
            supported=frozenset({"flash_attn", "torch_flash"}),
            layer_default="torch_sdpa",
            component_override=automatic("flash_attn"),
        )
        err = fails(request, NO_FLASH)
        assert err.code == "attention.unsupported_backend"
        assert err.message.startswith("backend 'torch_sdpa' is not supported")
        assert list(err.rejected) == ["flash_attn", "torch_sdpa", "torch_flash"]

    def test_nothing_available_is_no_backend(self) -> None:
        """When every fallback candidate is merely unavailable the error is no_backend."""
        platform = Platform("cpu", unavailable={"torch_sdpa": "off", "torch_flash": "off"})
        err = fails(layer(), platform)
        assert err.code == "attention.no_backend"
        assert err.message == (
            "no attention backend can serve layer 'self' (self) of component 'transformer' on "
            "this cpu platform (tried torch_flash, torch_sdpa)"
        )
        assert err.hint == (
            "make one of the tried backends available (torch_flash: off; torch_sdpa: off)"
        )

    def test_reference_is_never_a_fallback(self) -> None:
        """An automatic fallback never picks the reference, even when it alone would fit."""
        err = fails(layer(requirements=VARLEN), NO_FLASH)
        assert err.code == "attention.capability_missing"
        assert "reference" not in err.rejected
        assert err.hint == (
            "pick a backend that implements packed varlen attention (reference) "
            "for component 'transformer'"
        )

    def test_out_of_tree_backends_close_the_chain(self, out_of_tree: None) -> None:
        """After the platform preference, dense out-of-tree backends are tried; sparse never."""
        got = select_backend(layer(requirements=VARLEN), NO_FLASH)
        assert (got.backend, got.reason) == ("test_varlen", "platform default fallback")
        assert "test_sparse" not in got.rejected

    def test_hint_lists_capable_backends_from_the_registry(self, out_of_tree: None) -> None:
        """The capable backends in a hint come from the registry, out-of-tree ones included."""
        err = fails(layer(requirements=VARLEN, layer_backend="torch_sdpa"), Platform("cpu"))
        assert "(torch_flash, reference, test_sparse, test_varlen)" in err.hint

    def test_unknown_name_is_unsupported(self, cpu: Platform) -> None:
        """A name no registry knows is refused with the known names in the hint."""
        err = fails(layer(layer_backend="flashh"), cpu)
        assert err.code == "attention.unsupported_backend"
        assert err.message == (
            "backend 'flashh' is not a registered attention backend, so layer 'self' (self) "
            "of component 'transformer' cannot use it"
        )
        assert err.hint.startswith("pick a known backend (torch_sdpa, torch_flash, reference")

    def test_explicit_flash_for_a_bias_is_refused_by_capability(self, cpu: Platform) -> None:
        """An explicit torch_flash for a site adding a bias (T5) is capability_missing."""
        error = fails(
            layer(
                requirements=AttentionRequirements(additive_bias=True),
                component_override=explicit("torch_flash"),
            ),
            cpu,
        )
        assert error.code == "attention.capability_missing"
        assert "does not implement an additive attention bias" in str(error)
        assert "bias (torch_sdpa, reference) for component" in str(error)

    def test_automatic_flash_for_a_bias_falls_back(self, cpu: Platform) -> None:
        """An automatic torch_flash for a biased site falls back to a backend with the entry."""
        chosen = select_backend(
            layer(
                requirements=AttentionRequirements(additive_bias=True),
                component_override=automatic("torch_flash"),
            ),
            cpu,
        )
        assert chosen.backend == "torch_sdpa"
        assert chosen.reason == "platform default fallback"
        assert chosen.rejected == {
            "torch_flash": ("does not implement an additive attention bias",)
        }

    def test_causal_needs_the_causal_entry(self, cpu: Platform) -> None:
        """A backend whose kernel has no causal entry cannot serve a causal site."""
        register_backend(VarlenBackend)
        try:
            error = fails(
                layer(
                    requirements=AttentionRequirements(causal=True),
                    component_override=explicit("test_varlen"),
                ),
                cpu,
            )
        finally:
            registry.unregister_backend(VarlenBackend.name)
        assert error.code == "attention.capability_missing"
        assert "backend 'test_varlen' does not implement causal attention" in str(error)

    def test_ring_makes_default_selection_require_lse(self, cpu: Platform) -> None:
        """Under ring attention a default selection moves to a backend with softmax LSE."""
        got = select_backend(layer(ring=True), cpu)
        assert (got.backend, got.reason) == ("torch_flash", "platform default fallback")
        assert got.rejected == {"torch_sdpa": ("does not implement softmax LSE",)}

    def test_ring_refuses_an_explicit_backend_without_lse(self, cpu: Platform) -> None:
        """Under ring attention an explicit backend without LSE is parallel.ring_requires_lse."""
        request = layer(
            ring=True, layer_default="torch_flash", global_backend=explicit("torch_sdpa")
        )
        err = fails(request, cpu)
        assert err.code == "parallel.ring_requires_lse"
        assert err.message == (
            "backend 'torch_sdpa' does not implement softmax LSE, which ring attention on "
            "layer 'self' (self) of component 'transformer' requires"
        )
        assert err.hint == (
            "pick a backend with softmax LSE (torch_flash, reference) for component "
            "'transformer', or run it without ring attention (ring degree 1)"
        )

    def test_ring_lse_is_reported_once_beside_other_reasons(self, cpu: Platform) -> None:
        """Ring's LSE need is one reason, kept apart from the layer's own missing needs."""
        request = layer(requirements=VARLEN, ring=True, component_override=explicit("torch_sdpa"))
        err = fails(request, cpu)
        assert err.code == "parallel.ring_requires_lse"
        assert err.rejected == {
            "torch_sdpa": (
                "no softmax LSE, which ring attention needs",
                "does not implement packed varlen attention",
            )
        }

    def test_every_reason_a_candidate_fails_is_kept(self, cpu: Platform) -> None:
        """rejected lists each candidate's every reason in check order, not only the first."""
        request = layer(
            CROSS,
            requirements=VARLEN,
            supported=frozenset({"torch_sdpa", "torch_flash"}),
            role_override=explicit("sliding_window"),
        )
        got = select_backend(request, cpu)
        assert (got.backend, got.reason) == ("torch_flash", "dense cross-attention fallback")
        assert got.rejected == {
            "sliding_window": (
                "sparse, never used for cross-attention",
                "not in the layer's supported set",
                "does not implement packed varlen attention",
            ),
            "torch_sdpa": ("does not implement packed varlen attention",),
        }

    def test_a_candidate_is_explained_by_its_first_reason(self, cpu: Platform) -> None:
        """The error keeps its code from the candidate's first reason; the rest are in rejected."""
        request = layer(
            requirements=VARLEN,
            supported=frozenset({"torch_flash"}),
            component_override=explicit("torch_sdpa"),
        )
        err = fails(request, cpu)
        assert err.code == "attention.unsupported_backend"
        assert err.message.startswith("backend 'torch_sdpa' is not supported by this attention")
        assert err.rejected == {
            "torch_sdpa": (
                "not in the layer's supported set",
                "does not implement packed varlen attention",
            )
        }

    def test_no_backend_hint_names_every_reason(self) -> None:
        """With nothing left, the hint lists each tried backend with all of its reasons."""
        platform = Platform("cpu", unavailable={"torch_sdpa": "off", "torch_flash": "off"})
        err = fails(layer(requirements=VARLEN), platform)
        assert err.code == "attention.no_backend"
        assert err.hint == (
            "make one of the tried backends available (torch_flash: off; torch_sdpa: off and "
            "does not implement packed varlen attention)"
        )

    def test_ring_accepts_an_explicit_backend_with_lse(self, cpu: Platform) -> None:
        """Under ring attention an explicit backend with LSE is chosen as asked."""
        got = select_backend(layer(ring=True, component_override=explicit("reference")), cpu)
        assert (got.backend, got.reason) == ("reference", None)

    def test_selection_is_pure(self, cpu: Platform) -> None:
        """The same request gives equal selections and logs nothing."""
        request = layer(CROSS, requirements=VARLEN, role_override=explicit("sliding_window"))
        with capture_logs() as logs:
            first = select_backend(request, cpu)
            second = select_backend(request, cpu)
        assert first == second
        assert logs == []

    def test_choice_provenance_is_kept(self) -> None:
        """BackendChoice carries a name and a provenance, both required."""
        choice = BackendChoice(name="torch_sdpa", provenance=Provenance.AUTOMATIC)
        assert (choice.name, choice.provenance.value) == ("torch_sdpa", "automatic")
