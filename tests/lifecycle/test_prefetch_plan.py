"""The decision to prefetch the next request's first expert while a request decodes
(``lifecycle.admission.prefetch.plan_prefetch``): every branch, and over a grid of sizes
never past the budget."""

from __future__ import annotations

import itertools

import pytest

from lifecycle.admission.prefetch import AheadStage, PrefetchDecision, plan_prefetch

KIB = 1024
EXPERT = 200 * KIB
VAE = 80 * KIB
ENCODER = 380 * KIB
ENCODE = AheadStage(name="encode", held={"text_encoder": ENCODER})


def decide(
    budget: int | None,
    *,
    kept: dict[str, int] | None = None,
    pinned: dict[str, int] | None = None,
    ahead: tuple[AheadStage, ...] = (ENCODE,),
    offloaded: bool = True,
    streams_blocks: bool = False,
    waiting: bool = False,
) -> PrefetchDecision:
    """Ask for ``transformer`` (200 KiB) beside the VAE in use, by default."""
    return plan_prefetch(
        "transformer",
        offloaded=offloaded,
        streams_blocks=streams_blocks,
        needed=EXPERT,
        budget=budget,
        kept={"vae": VAE} if kept is None else kept,
        pinned=pinned or {},
        ahead=ahead,
        waiting=waiting,
    )


class TestPlanPrefetch:
    """Each reason to prefetch or not, with its words and numbers."""

    def test_fits_beside_the_decode_and_the_stages_before(self) -> None:
        """A budget of the expert plus the largest stage before it prefetches."""
        decision = decide(EXPERT + ENCODER)
        assert decision.prefetch
        assert decision.reason == (
            "'transformer' (200.0 KiB) fits beside the 80.0 KiB kept on the device now and "
            "beside every stage before its use, within the 580.0 KiB of memory.device_budget"
        )

    def test_no_budget_prefetches(self) -> None:
        """Without a device budget the expert always comes ahead."""
        decision = decide(None)
        assert (decision.prefetch, decision.reason) == (
            True,
            "no device budget: 'transformer' onloads while this request decodes",
        )

    def test_not_beside_what_is_kept_now(self) -> None:
        """A budget below the expert plus the VAE in use refuses, naming both."""
        decision = decide(EXPERT + VAE - KIB)
        assert not decision.prefetch
        assert decision.reason == (
            "'transformer' needs 200.0 KiB beside the 80.0 KiB kept on the device now (vae): "
            "280.0 KiB, over the 279.0 KiB of memory.device_budget"
        )

    def test_not_beside_a_stage_before_its_use(self) -> None:
        """An expert the next request's encode stage would evict is not moved twice."""
        decision = decide(EXPERT + ENCODER - KIB)
        assert not decision.prefetch
        assert decision.reason == (
            "'transformer' needs 200.0 KiB beside the 380.0 KiB stage 'encode' of the next "
            "request holds before its use: 580.0 KiB, over the 579.0 KiB of "
            "memory.device_budget; it "
            "would be evicted unused"
        )

    def test_pinned_components_count_in_every_stage_before(self) -> None:
        """What stays on the device for good counts beside each earlier stage."""
        pinned = {"vae": VAE}
        assert not decide(EXPERT + ENCODER, pinned=pinned).prefetch
        assert decide(EXPERT + ENCODER + VAE, pinned=pinned).prefetch

    def test_nothing_to_move(self) -> None:
        """An expert already on the device is not moved."""
        decision = decide(None, offloaded=False)
        assert (decision.prefetch, decision.reason) == (
            False,
            "'transformer' is not offloaded: nothing to move",
        )

    def test_layerwise_is_never_onloaded_whole(self) -> None:
        """A layerwise expert streams its blocks; a prefetch would hold it whole."""
        decision = decide(None, streams_blocks=True)
        assert not decision.prefetch
        assert "layerwise offloaded" in decision.reason

    def test_requests_waiting_for_memory_go_first(self) -> None:
        """While requests wait for memory, nothing is taken for a request not yet here."""
        decision = decide(None, waiting=True)
        assert (decision.prefetch, decision.reason) == (
            False,
            "requests wait for memory: they go first",
        )


SIZES = (0, 50 * KIB, 100 * KIB, 200 * KIB, 400 * KIB)


@pytest.mark.parametrize("budget", [EXPERT + s for s in SIZES] + [EXPERT - 1])
def test_never_past_the_budget(budget: int) -> None:
    """Over a grid of what is kept, pinned and held before, a prefetch fits the budget now
    and beside every earlier stage, and a refusal names a set that does not."""
    for kept, pinned, encode, second in itertools.product(SIZES, SIZES, SIZES, SIZES):
        ahead = (
            AheadStage(name="encode", held={"text_encoder": encode}),
            AheadStage(name="other", held={"other": second}),
        )
        decision = decide(
            budget, kept={"vae": kept, "pinned": pinned}, pinned={"pinned": pinned}, ahead=ahead
        )
        now = kept + pinned + EXPERT
        before = max(pinned + encode, pinned + second) + EXPERT
        assert decision.prefetch == (now <= budget and before <= budget), (kept, pinned, encode)
