"""Attention: chosen once, armed only while resident, the declared paths only."""

from __future__ import annotations

import pickle

import pytest
import torch
from structlog.testing import capture_logs
from torch import nn

from attention import (
    Attention,
    AttentionRequirements,
    AttentionRole,
    BackendSelectionError,
    ComponentRequests,
    NotResidentError,
    Platform,
    arm_layers,
    component_attention_scope,
    disarm_layers,
    registry,
)
from attention.testing import TOLERANCE, RandomInputs, explicit, rel_err

# B batch, H heads, S seq, D head dim, T packed tokens

SELF, CROSS = AttentionRole.SELF, AttentionRole.CROSS
ALL = AttentionRequirements(packed_varlen=True, softmax_lse=True, attention_mask=True)


def built(backend: str, platform: Platform, requirements: AttentionRequirements = ALL) -> Attention:
    """Build an armed layer of component 'transformer' running ``backend`` on ``platform``."""
    with component_attention_scope(
        ComponentRequests(component="transformer", component_backend=explicit(backend)),
        platform=platform,
    ):
        layer = Attention("self", SELF, requirements=requirements)
    layer.arm()
    return layer


class Block(nn.Module):
    """A small module tree with two attention layers."""

    def __init__(self) -> None:
        super().__init__()
        self.attn = Attention("self", SELF)
        self.inner = nn.Sequential(nn.Identity(), Attention("cross", CROSS))


class TestAttention:
    """The layer's construction, arming and forward paths."""

    def test_starts_disarmed_and_refuses_to_run(self, cpu: Platform, inputs: RandomInputs) -> None:
        """A new layer is disarmed; its forward raises NotResidentError naming the component."""
        with component_attention_scope(ComponentRequests(component="vae"), platform=cpu):
            layer = Attention("mid", SELF)
        q, k, v = inputs.qkv(1, 2, 2, 4, 4, 8, dtype=torch.float32)
        assert layer.is_armed is False
        with pytest.raises(NotResidentError) as err:
            layer(q, k, v)
        assert str(err.value) == (
            "attention layer 'mid' of component 'vae' ran while its component is not resident "
            "(the layer is disarmed); onload component 'vae' before running it"
        )
        assert err.value.component == "vae"

    def test_armed_layer_runs_and_disarmed_again_refuses(
        self, cpu: Platform, inputs: RandomInputs
    ) -> None:
        """Armed, forward equals the kernel; disarmed again, it refuses once more."""
        layer = built("torch_sdpa", cpu, AttentionRequirements(causal=True))
        q, k, v = inputs.qkv(2, 4, 2, 6, 9, 8, dtype=torch.float64)
        direct = registry.get("torch_sdpa").make_impl().forward_causal(q, k, v, scale=None)
        assert torch.equal(layer(q, k, v, is_causal=True), direct)
        layer.disarm()
        with pytest.raises(NotResidentError):
            layer(q, k, v)

    def test_every_path_refuses_when_disarmed(self, cpu: Platform, inputs: RandomInputs) -> None:
        """forward_varlen and forward_with_lse are guarded like forward."""
        layer = built("reference", cpu)
        layer.disarm()
        q = inputs.tensor(5, 2, 8)
        cu = torch.tensor([0, 5])
        with pytest.raises(NotResidentError):
            layer.forward_varlen(q, q, q, cu, cu, 5, 5)
        with pytest.raises(NotResidentError):
            layer.forward_with_lse(q[None], q[None], q[None])

    def test_arm_and_disarm_a_module_tree(self, cpu: Platform) -> None:
        """arm_layers and disarm_layers reach every nested layer and count them."""
        with component_attention_scope(ComponentRequests(component="transformer"), platform=cpu):
            block = Block()
        assert arm_layers(block) == 2
        assert block.attn.is_armed
        assert disarm_layers(block) == 2
        assert not any(m.is_armed for m in block.modules() if isinstance(m, Attention))
        assert arm_layers(nn.Linear(2, 2)) == 0

    def test_paths_match_the_reference(self, cpu: Platform, inputs: RandomInputs) -> None:
        """Masked, varlen and LSE paths of a torch_flash layer match the reference."""
        layer, ref = built("torch_flash", cpu), built("reference", cpu)
        q, k, v = inputs.qkv(1, 4, 2, 10, 10, 16, dtype=torch.float64)
        mask = inputs.keep_mask(10, 10)
        assert (
            rel_err(layer(q, k, v, attn_mask=mask), ref(q, k, v, attn_mask=mask))
            < TOLERANCE[torch.float64]
        )
        out, lse = layer.forward_with_lse(q, k, v)
        ref_out, ref_lse = ref.forward_with_lse(q, k, v)
        assert rel_err(out, ref_out) < TOLERANCE[torch.float64]
        assert rel_err(lse, ref_lse) < TOLERANCE[torch.float64]
        packed = q[0].transpose(0, 1)  # (T, H, D)
        cu = torch.tensor([0, 3, 10])
        assert (
            rel_err(
                layer.forward_varlen(packed, packed, packed, cu, cu, 7, 7),
                ref.forward_varlen(packed, packed, packed, cu, cu, 7, 7),
            )
            < TOLERANCE[torch.float64]
        )

    def test_scale_is_passed_to_the_kernel(self, cpu: Platform, inputs: RandomInputs) -> None:
        """A layer's scale reaches its kernel."""
        with component_attention_scope(ComponentRequests(component="t"), platform=cpu):
            layer = Attention("self", SELF, scale=0.3)
            ref = Attention("self", SELF, backend="reference", scale=0.3)
        arm_layers(layer)
        arm_layers(ref)
        q, k, v = inputs.qkv(1, 2, 2, 5, 5, 8, dtype=torch.float64)
        assert rel_err(layer(q, k, v), ref(q, k, v)) < TOLERANCE[torch.float64]

    def test_undeclared_paths_are_refused(self, cpu: Platform, inputs: RandomInputs) -> None:
        """A mask, packed input or LSE the layer did not declare raises, naming the flag."""
        layer = built("reference", cpu, AttentionRequirements())
        q, k, v = inputs.qkv(1, 2, 2, 4, 4, 8, dtype=torch.float64)
        with pytest.raises(
            ValueError, match=r"declare AttentionRequirements\(attention_mask=True\)"
        ):
            layer(q, k, v, attn_mask=torch.ones(4, 4, dtype=torch.bool))
        cu = torch.tensor([0, 4])
        with pytest.raises(ValueError, match=r"AttentionRequirements\(packed_varlen=True\)"):
            layer.forward_varlen(q[0], k[0], v[0], cu, cu, 4, 4)
        with pytest.raises(ValueError, match=r"AttentionRequirements\(softmax_lse=True\)"):
            layer.forward_with_lse(q, k, v)
        with pytest.raises(ValueError, match=r"AttentionRequirements\(additive_bias=True\)"):
            layer(q, k, v, bias=torch.zeros(4, 4, dtype=torch.float64))
        with pytest.raises(ValueError, match=r"AttentionRequirements\(causal=True\)"):
            layer(q, k, v, is_causal=True)

    def test_causal_packed_and_lse_calls_need_causal_declared(
        self, cpu: Platform, inputs: RandomInputs
    ) -> None:
        """The causal flag of the packed and LSE entries is refused on a site not declaring it."""
        layer = built("reference", cpu, ALL)
        q, k, v = inputs.qkv(1, 2, 2, 4, 4, 8, dtype=torch.float64)
        cu = torch.tensor([0, 4])
        with pytest.raises(ValueError, match=r"AttentionRequirements\(causal=True\)"):
            layer.forward_varlen(q[0], k[0], v[0], cu, cu, 4, 4, is_causal=True)
        with pytest.raises(ValueError, match=r"AttentionRequirements\(causal=True\)"):
            layer.forward_with_lse(q, k, v, is_causal=True)

    def test_mask_bias_and_causal_are_one_at_a_time(
        self, cpu: Platform, inputs: RandomInputs
    ) -> None:
        """Two of attn_mask, bias and is_causal in one call raise: one is folded into the bias."""
        everything = AttentionRequirements(attention_mask=True, additive_bias=True, causal=True)
        layer = built("reference", cpu, everything)
        q, k, v = inputs.qkv(1, 2, 2, 4, 4, 8, dtype=torch.float64)
        bias = inputs.tensor(4, 4)
        with pytest.raises(ValueError, match="more than one of attn_mask, bias and is_causal"):
            layer(q, k, v, bias=bias, is_causal=True)
        ref = registry.get("reference").make_impl()
        assert torch.equal(layer(q, k, v, bias=bias), ref.forward_biased(q, k, v, bias, scale=None))
        assert torch.equal(layer(q, k, v, is_causal=True), ref.forward_causal(q, k, v, scale=None))

    def test_ring_layer_may_ask_for_the_lse(self, cpu: Platform, inputs: RandomInputs) -> None:
        """Under ring attention a self layer may call forward_with_lse undeclared."""
        with component_attention_scope(
            ComponentRequests(component="transformer", ring=True), platform=cpu
        ):
            layer = Attention("self", SELF)
        layer.arm()
        q, k, v = inputs.qkv(1, 2, 2, 4, 4, 8, dtype=torch.float64)
        assert layer.forward_with_lse(q, k, v)[1].shape == (1, 2, 4)

    def test_unscoped_layer_takes_the_default(self) -> None:
        """Outside any scope a layer takes its default under component '<unscoped>'."""
        with capture_logs() as logs:
            layer = Attention("self", SELF, default="reference")
        assert (layer.component, layer.backend_name, layer.selection.reason) == (
            "<unscoped>",
            "reference",
            None,
        )
        assert [e["event"] for e in logs] == ["attention.selected"]

    def test_selection_error_at_construction(self, cpu: Platform) -> None:
        """A layer no backend may serve fails at construction, naming its component."""
        with (
            pytest.raises(BackendSelectionError, match="of component 'vae' requires"),
            component_attention_scope(
                ComponentRequests(component="vae", component_backend=explicit("torch_sdpa")),
                platform=cpu,
            ),
        ):
            Attention("mid", SELF, requirements=AttentionRequirements(softmax_lse=True))

    def test_repr_shows_backend_and_arming(self, cpu: Platform) -> None:
        """The module repr shows site, role, backend and whether it is armed."""
        with component_attention_scope(ComponentRequests(component="t"), platform=cpu):
            layer = Attention("self", CROSS)
        assert (
            repr(layer) == "Attention(site='self', role=cross, backend='torch_sdpa', armed=False)"
        )

    def test_errors_survive_pickling(self) -> None:
        """Both errors keep their fields across a process boundary (pickle)."""
        resident = pickle.loads(pickle.dumps(NotResidentError("vae", "mid")))
        assert (resident.component, resident.site) == ("vae", "mid")
        selection = pickle.loads(
            pickle.dumps(
                BackendSelectionError("attention.no_backend", "vae", "m", "h", {"a": ("b",)})
            )
        )
        assert (selection.code, selection.component, selection.rejected) == (
            "attention.no_backend",
            "vae",
            {"a": ("b",)},
        )
        assert str(selection) == "m; fix: h"
