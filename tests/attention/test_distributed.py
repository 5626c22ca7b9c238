"""Distributed attention on two real gloo processes equals attention over the whole sequence."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest
import torch

from attention import AttentionImpl, BackendSelectionError, registry
from attention.distributed import kv_gather_attention, ring_attention, ulysses_attention
from tests.attention.distributed_worker import CASES, Outcome, layer, run_cases
from tests.ranks import run_ranks

# B batch, H heads, S seq, D head dim

WORLD = 2
# Float32 shards against the float32 reference: max|out - ref| / max|ref|. The worst seen
# was about 4e-7 (the LSE merge and the kernels round differently); 2e-6 leaves room.
TOLERANCE = 2e-6
DEADLINE_S = 60.0

Outcomes = dict[str, list[Outcome]]


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory: pytest.TempPathFactory) -> Outcomes:
    """Every case's outcome on each rank, from one spawn of two gloo processes."""
    out_dir = tmp_path_factory.mktemp("distributed")
    exits = run_ranks(run_cases, WORLD, out_dir, str(out_dir), deadline_s=DEADLINE_S)
    assert exits == [0] * WORLD, f"worker exit codes {exits} (tracebacks on stderr)"
    decoder = msgspec.json.Decoder(dict[str, Outcome])
    ranks = [decoder.decode(Path(out_dir, f"rank{r}.json").read_bytes()) for r in range(WORLD)]
    return {name: [rank[name] for rank in ranks] for name in CASES}


def assert_equal_to_full(outcomes: Outcomes, case: str) -> None:
    """Assert every rank ran ``case`` and its gathered output is within TOLERANCE."""
    for rank, outcome in enumerate(outcomes[case]):
        assert outcome.error is None, f"rank {rank}: {outcome.trace}"
        assert outcome.rel_err is not None
        assert outcome.rel_err < TOLERANCE, f"rank {rank}: relative error {outcome.rel_err}"


def impl(name: str) -> AttentionImpl:
    """Build backend ``name``'s kernel with its default options."""
    return registry.get(name).make_impl()


class TestUlysses:
    """Ulysses attention: all-to-all from sequence shards to head shards and back."""

    def test_equals_full_attention(self, outcomes: Outcomes) -> None:
        """Two ranks holding half the sequence each reproduce full attention."""
        assert_equal_to_full(outcomes, "ulysses")

    def test_grouped_query(self, outcomes: Outcomes) -> None:
        """K/V heads that divide by the group are split alongside their query heads."""
        assert_equal_to_full(outcomes, "ulysses_gqa")

    def test_single_kv_head(self, outcomes: Outcomes) -> None:
        """One K/V head over two ranks is repeated until it splits, and stays exact."""
        assert_equal_to_full(outcomes, "ulysses_mqa")

    def test_causal(self, outcomes: Outcomes) -> None:
        """Causal masking applies over the whole sequence, not per shard."""
        assert_equal_to_full(outcomes, "ulysses_causal")

    def test_heads_not_divisible(self, outcomes: Outcomes) -> None:
        """Three query heads over two ranks are refused with the fix, on every rank."""
        for outcome in outcomes["ulysses_heads"]:
            assert outcome.error == (
                "ValueError: ulysses attention splits the query heads over the 2 ranks of its "
                "group, but q has 3 heads, which 2 does not divide; make the heads a multiple "
                "of the ulysses degree (parallel.ulysses_degree), or use ring or K/V gather "
                "attention for this layer"
            )


class TestRing:
    """Ring attention: K/V blocks rotate, partial outputs merge by their LSE."""

    def test_torch_flash_equals_full_attention(self, outcomes: Outcomes) -> None:
        """A torch_flash layer built under a ring scope reproduces full attention."""
        assert_equal_to_full(outcomes, "ring_torch_flash")

    def test_reference_equals_full_attention(self, outcomes: Outcomes) -> None:
        """The bare reference kernel, merged over the ring, reproduces full attention."""
        assert_equal_to_full(outcomes, "ring_reference")

    def test_grouped_query(self, outcomes: Outcomes) -> None:
        """Grouped-query K/V blocks rotate with their fewer heads and stay exact."""
        assert_equal_to_full(outcomes, "ring_gqa")

    def test_causal(self, outcomes: Outcomes) -> None:
        """Causal ring attention skips later blocks and masks only the rank's own block."""
        assert_equal_to_full(outcomes, "ring_causal")

    def test_refuses_kernel_without_lse(self) -> None:
        """A bare torch_sdpa kernel is refused with parallel.ring_requires_lse before any I/O."""
        q = torch.zeros(1, 2, 4, 8)
        with pytest.raises(BackendSelectionError) as err:
            ring_attention(q, q, q, impl("torch_sdpa"))
        assert err.value.code == "parallel.ring_requires_lse"
        assert err.value.component == "<unscoped>"
        assert err.value.message == (
            "backend 'torch_sdpa' does not implement softmax LSE, which ring attention on "
            "kernel TorchSdpaImpl requires to merge the partial results of its K/V blocks"
        )
        assert err.value.hint == (
            "pick a backend with softmax LSE (torch_flash, reference, flash_attn) for "
            "component '<unscoped>', or run it without ring attention (ring degree 1; "
            "ulysses and K/V gather need no LSE)"
        )

    def test_refuses_layer_without_lse(self) -> None:
        """A torch_sdpa layer is refused naming its site and component."""
        q = torch.zeros(1, 2, 4, 8)
        with pytest.raises(BackendSelectionError) as err:
            ring_attention(q, q, q, layer("torch_sdpa"))
        assert err.value.code == "parallel.ring_requires_lse"
        assert err.value.message.startswith(
            "backend 'torch_sdpa' does not implement softmax LSE, which ring attention on "
            "layer 'self' (self) of component 'transformer' requires"
        )

    def test_refuses_layer_not_allowed_to_return_lse(self) -> None:
        """A torch_flash layer built without ring attention is refused before any I/O."""
        q = torch.zeros(1, 2, 4, 8)
        with pytest.raises(ValueError, match="may not return the softmax LSE") as err:
            ring_attention(q, q, q, layer("torch_flash"))
        assert str(err.value).startswith("layer 'self' (self) of component 'transformer'")


class TestKvGather:
    """K/V gather attention: all-gather K/V along the sequence, attend locally."""

    def test_equals_full_attention(self, outcomes: Outcomes) -> None:
        """A torch_sdpa layer over the gathered K/V reproduces full attention."""
        assert_equal_to_full(outcomes, "kv_gather")

    def test_grouped_query(self, outcomes: Outcomes) -> None:
        """Grouped-query K/V are gathered with their fewer heads."""
        assert_equal_to_full(outcomes, "kv_gather_gqa")


class TestLocalKernel:
    """The local attention every variant calls: a layer or a bare kernel."""

    @pytest.mark.parametrize("variant", [ulysses_attention, ring_attention, kv_gather_attention])
    def test_scale_with_layer_is_refused(self, variant: object) -> None:
        """A scale passed with a layer, which has its own, is an error before any I/O."""
        q = torch.zeros(1, 2, 4, 8)
        with pytest.raises(ValueError, match=r"^layer 'self' of component 'transformer' has"):
            variant(q, q, q, layer("torch_flash", ring=True), scale=0.5)  # type: ignore[operator]
