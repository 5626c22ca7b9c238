"""What a move reads instead of walking: cached attention layers, timeline tables, held bytes."""

from __future__ import annotations

import itertools
import math
import random
from pathlib import Path

import msgspec
import pytest
from torch import nn

from attention import (
    Attention,
    AttentionRole,
    ComponentRequests,
    Platform,
    component_attention_scope,
)
from components import ResidencyMode, registry
from lifecycle.device.slots import ComponentSlot
from lifecycle.device.timeline import Timeline
from lifecycle.machines.component import ComponentLifecycle
from lifecycle.machines.tables import TRANSITIONS, ComponentState
from lifecycle.orchestrator import Orchestrator
from lifecycle.refusals import TransitionRefused
from lifecycle.spec.reading import load_spec
from lifecycle.spec.structs import ComponentSpec, StageSpec, StepWindow
from tests.lifecycle.conftest import VAE_BYTES, VaePipeline

ROOT = Path(__file__).resolve().parents[2]
CPU = Platform("cpu")


def attention_net(layers: int) -> nn.Module:
    """Build a module holding ``layers`` attention layers, each nested one level down."""
    with component_attention_scope(ComponentRequests(component="net"), platform=CPU):
        return nn.ModuleList(
            nn.ModuleDict({"attn": Attention(f"s{i}", AttentionRole.SELF)}) for i in range(layers)
        )


def bare_slot() -> ComponentSlot:
    """Return the slot of one component whose guards all pass."""
    needed = {n for r in TRANSITIONS for n in (*r.guards, r.postcondition) if n is not None}
    lifecycle = ComponentLifecycle("net", checks={n: (lambda context: ()) for n in needed})
    spec = msgspec.convert({"kind": "tiny_vae"}, ComponentSpec)
    return ComponentSlot("net", spec, lifecycle, registry.get(spec.kind).from_options(spec.options))


class TestLayerCache:
    def test_layers_are_found_when_the_module_is_set(self) -> None:
        """Setting a module caches exactly its attention layers, in module order."""
        slot = bare_slot()
        module = attention_net(3)
        slot.module = module
        assert slot.layers == tuple(m for m in module.modules() if isinstance(m, Attention))
        assert len(slot.layers) == 3

    def test_a_rebuilt_module_gets_its_own_layers(self) -> None:
        """A second module set on the slot replaces the cached layers; forgetting clears them."""
        slot = bare_slot()
        first, second = attention_net(2), attention_net(4)
        slot.module = first
        slot.module = second
        assert len(slot.layers) == 4
        assert all(any(layer is m for m in second.modules()) for layer in slot.layers)
        slot.forget()
        assert slot.layers == ()

    def test_moves_arm_and_disarm_the_cached_layers(self, tmp_path: Path) -> None:
        """Onload arms every attention layer of the module, offload disarms every one."""
        spec = load_spec(ROOT / "examples" / "tiny_t2i.toml")
        with Orchestrator(spec, platform=CPU) as orch:
            orch.load()
            layers = [m for m in orch.module("vae").modules() if isinstance(m, Attention)]
            assert layers
            assert not any(layer.is_armed for layer in layers)
            orch.onload("vae")
            assert all(layer.is_armed for layer in layers)
            orch.offload("vae")
            assert not any(layer.is_armed for layer in layers)


def brute_next_use(stages: list[tuple[str, ...]], name: str, after: int) -> int | None:
    """Scan the stages after ``after`` for ``name``: what the timeline's tables must say."""
    return next((p for p in range(after + 1, len(stages)) if name in stages[p]), None)


class TestTimelineTables:
    @pytest.mark.parametrize("seed", range(5))
    def test_tables_agree_with_a_scan(self, seed: int) -> None:
        """Next use, last uses and what the next stage adds equal a scan of the stages."""
        rng = random.Random(seed)
        names = [f"c{i}" for i in range(6)]
        stages = [tuple(rng.sample(names, rng.randint(1, 3))) for _ in range(9)]
        timeline = Timeline([StageSpec(name=f"s{i}", uses=u) for i, u in enumerate(stages)])
        for position, name in itertools.product(range(-1, len(stages)), [*names, "absent"]):
            assert timeline.next_use(name, position) == brute_next_use(stages, name, position)
        for position, uses in enumerate(stages):
            last = tuple(n for n in uses if brute_next_use(stages, n, position) is None)
            assert timeline.last_uses(position) == last
            later = stages[position + 1] if position + 1 < len(stages) else ()
            assert timeline.added_next(position) == tuple(n for n in later if n not in uses)
        assert [timeline.is_used(n) for n in names] == [any(n in u for u in stages) for n in names]

    def test_experts_in_the_order_they_run(self) -> None:
        """The second expert of a stage with step windows is needed later than the first (so
        the budget evicts it first), and the first is what the last stage prefetches."""
        windows = {"t1": StepWindow(from_timestep=875.0), "t2": StepWindow(below_timestep=875.0)}
        timeline = Timeline(
            [
                StageSpec(name="encode", uses=("text",)),
                StageSpec(name="denoise", uses=("t1", "t2"), windows=windows),
                StageSpec(name="decode", uses=("vae",)),
            ]
        )
        assert timeline.distance_to_next_use("t1", 0) == 1
        assert timeline.distance_to_next_use("t2", 0) == 1.5
        assert timeline.distance_to_next_use("text", 0) == math.inf
        assert timeline.first_expert == (1, "t1")
        assert (
            Timeline([StageSpec(name="s", uses=("t1", "t2"), windows=windows)]).first_expert is None
        )


BUDGET_STAGES = {"s0": ["a"], "s1": ["b"], "s2": ["c"], "s3": ["a", "b"]}
"""Two offloaded VAEs (a, b) and one resident by default (c), which the budget may evict."""


class TestBudgetRunningTotal:
    def test_running_total_keeps_the_budget_through_mixed_moves(
        self, vae_pipeline: VaePipeline
    ) -> None:
        """Across random requests and manual moves the budget holds, and what fits is onloaded."""
        budget = 2 * VAE_BYTES + 1000
        spec = vae_pipeline(budget, BUDGET_STAGES, residency={"c": None})
        rng = random.Random(0)
        with Orchestrator(spec, platform=CPU) as orch:
            orch.load()
            for _ in range(40):
                action = rng.choice(["request", "onload", "offload"])
                name = rng.choice("abc")
                if action == "request":
                    with orch.request() as request:
                        for stage in rng.sample(["s0", "s1", "s2", "s3"], rng.randint(1, 4)):
                            with request.stage(stage):
                                assert orch.resident_bytes() <= budget
                elif action == "onload":
                    if orch.state(name) is not ComponentState.RESIDENT:
                        orch.onload(name)  # two of three fit: an idle one is always evictable
                elif (
                    orch.component(name).spec.residency_mode is not ResidencyMode.RESIDENT
                    and orch.state(name) is ComponentState.RESIDENT
                ):
                    orch.offload(name)
                assert orch.resident_bytes() <= budget
            orch.release("a")
            orch.onload("b")
            orch.onload("c")  # a's bytes were given back by its release
            assert orch.resident_bytes() == 2 * VAE_BYTES

    def test_a_refused_onload_leaves_the_total_unchanged(self, vae_pipeline: VaePipeline) -> None:
        """After a refusal the same onload succeeds once the stage's users let go."""
        spec = vae_pipeline(2 * VAE_BYTES + 1000, BUDGET_STAGES, residency={"c": None})
        with Orchestrator(spec, platform=CPU) as orch:
            orch.load()
            with orch.request("r1") as first, first.stage("s3"):
                assert orch.state("c") is ComponentState.OFFLOADED  # evicted for a and b
                with pytest.raises(TransitionRefused):
                    orch.onload("c")
                assert orch.state("c") is ComponentState.OFFLOADED
            orch.onload("c")  # a and b went back after their last use: c fits now
            assert orch.resident_bytes() == VAE_BYTES
