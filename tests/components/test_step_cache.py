"""Step caches (``components.cache``): their decisions, and the tiny DiT running under them.

The tiny DiT runs with its timestep MLP smoothed (``tests.components.smooth_dit``): its
seeded weights would make every step look new to a cache. Every test that runs a cache
asserts that steps were skipped.
"""

from __future__ import annotations

import math

import pytest
import torch

from attention import ComponentRequests, Platform, arm_layers, component_attention_scope
from components.batch import Batch
from components.cache import CacheSettings, RowCache
from components.cache.decide import (
    l1_parts,
    must_compute,
    on_interval,
    relative_change,
    taylor_predict,
    taylor_update,
)
from components.kinds.tiny_dit import TinyDit, TinyDitLoader, TinyDitOptions
from tests.components.smooth_dit import smoothed_dit

pytestmark = pytest.mark.usefixtures("one_thread")

FIRST_BLOCK = CacheSettings(method="first_block", threshold=0.1)
TAYLOR_SEER = CacheSettings(method="taylor_seer", interval=3)
STEPS = 16
TOKENS = (16, 9, 25)  # three requests of different sizes, packed in one forward


def psnr(ours: torch.Tensor, reference: torch.Tensor) -> float:
    """Return the PSNR of ``ours`` against ``reference`` in dB (the reference's range)."""
    mse = float(((ours - reference) ** 2).mean())
    peak = float(reference.max() - reference.min())
    return math.inf if mse == 0 else 10 * math.log10(peak**2 / mse)


def seeded(
    settings: CacheSettings | None,
    rows: tuple[int, ...] = TOKENS,
    *,
    cache: bool | list[bool] = True,
    guidance: float = 4.0,
    steps: int = STEPS,
) -> tuple[TinyDitLoader, TinyDit, Batch]:
    """Return the smoothed tiny DiT under ``settings`` and a batch of seeded requests of
    ``rows`` tokens each.

    Request ``i``'s latents and text are drawn from seed ``i`` whatever else it shares
    the batch with, so a request alone draws what it draws in a batch.
    """
    loader = TinyDitLoader(TinyDitOptions(seed=7))
    loader.cache = settings
    generators = [torch.Generator().manual_seed(i) for i in rows]
    batch = Batch(
        generator=torch.Generator().manual_seed(0),
        steps=steps,
        size=len(rows),
        guidance_scale=guidance,
        latents=[torch.randn(n, 4, generator=g) for n, g in zip(rows, generators, strict=True)],
        context=[torch.randn(3, 32, generator=g) for g in generators],
        cache=cache,
    )
    return loader, smoothed_dit(loader), batch


def denoise(
    settings: CacheSettings | None,
    rows: tuple[int, ...] = TOKENS,
    *,
    cache: bool | list[bool] = True,
    guidance: float = 4.0,
    steps: int = STEPS,
) -> Batch:
    """Denoise ``seeded`` requests on the smoothed tiny DiT; the batch."""
    loader, module, batch = seeded(settings, rows, cache=cache, guidance=guidance, steps=steps)
    with torch.inference_mode():
        loader.run(module, batch)
    return batch


def caches(batch: Batch) -> list[RowCache]:
    """Return every row's cache (each row ran one)."""
    rows = batch.cache_rows
    assert rows is not None
    assert all(row is not None for row in rows)
    return [row for row in rows if row is not None]


class TestDecisions:
    """What is computed, skipped and predicted, on plain numbers."""

    def test_warmup_final_short_and_unprimed_steps_compute(self) -> None:
        """Warm-up and final steps, a request too short to skip, an unprimed row and the step
        after max_skipped skips are computed whatever the cache measures."""
        settings = CacheSettings(method="first_block", warmup_steps=2, final_steps=1, max_skipped=2)
        free = [s for s in range(10) if not must_compute(settings, s, 10, 0, primed=True)]
        assert free == [2, 3, 4, 5, 6, 7, 8]
        assert must_compute(settings, 5, 10, 0, primed=False)
        assert must_compute(settings, 5, 10, 2, primed=True)
        assert not must_compute(settings, 5, 10, 1, primed=True)
        assert all(must_compute(settings, s, 3, 0, primed=True) for s in range(3))
        assert settings.uncached_reason(3) == (
            "3 steps leave nothing to skip: warmup_steps (2) + final_steps (1) are always computed"
        )
        assert settings.uncached_reason(4) is None

    def test_taylor_seer_computes_every_interval_after_warmup(self) -> None:
        """With a warm-up of 2 and an interval of 4, steps 5 and 9 are the full ones between."""
        settings = CacheSettings(method="taylor_seer", warmup_steps=2, interval=4)
        assert [s for s in range(2, 12) if on_interval(settings, s)] == [5, 9]

    def test_taylor_expansion_extrapolates_a_line(self) -> None:
        """First order predicts a line exactly from values computed unevenly apart; order
        0 repeats the last one."""

        def value(step: int) -> torch.Tensor:
            return torch.tensor([3.0 + 2.0 * step])

        for order, expected in ((1, value(8)), (0, value(5))):
            factors: list[torch.Tensor] = []
            last = None
            for step in (0, 3, 5):
                distance = 0 if last is None else step - last
                factors = taylor_update(factors, value(step), distance, order)
                last = step
            assert len(factors) == order + 1
            assert torch.allclose(taylor_predict(factors, 3), expected)

    def test_relative_change_adds_parts_held_apart(self) -> None:
        """The change of a row measured in two halves (two ranks, two branches) is its change
        measured whole."""
        generator = torch.Generator().manual_seed(0)
        now, before = (
            torch.randn(10, 4, generator=generator),
            torch.randn(10, 4, generator=generator),
        )
        whole = relative_change(l1_parts(now, before))
        halves = l1_parts(now[:4], before[:4]) + l1_parts(now[4:], before[4:])
        assert relative_change(halves) == pytest.approx(whole, rel=1e-12)
        assert whole == pytest.approx(
            float((now - before).abs().mean() / before.abs().mean()), rel=1e-6
        )

    def test_settings_describe_every_default(self) -> None:
        """check's table and JSON spell out the defaults of the method chosen, and only its."""
        settings = CacheSettings(method="taylor_seer")
        assert settings.describe() == "taylor_seer (interval 4, order 1; warmup 2, final 1)"
        resolved = settings.resolved()
        assert (resolved.interval, resolved.order) == (4, 1)
        assert isinstance(resolved.threshold, type(settings.threshold))  # still unset
        bounded = CacheSettings(method="first_block", max_skipped=3)
        assert (
            bounded.describe() == "first_block (threshold 0.08; warmup 2, final 1, max 3 skipped)"
        )


class TestTinyDit:
    """The tiny DiT's denoising loop under a cache, row by row in one packed forward."""

    @pytest.mark.parametrize("settings", [FIRST_BLOCK, TAYLOR_SEER], ids=["first_block", "taylor"])
    def test_skips_steps_close_to_uncached(self, settings: CacheSettings) -> None:
        """Every row skips steps, and its latents stay above 35 dB of the uncached run's."""
        cached = denoise(settings)
        uncached = denoise(None)
        assert uncached.cache_rows is None
        for row, ours, reference in zip(
            caches(cached), cached.latents or [], uncached.latents or [], strict=True
        ):
            assert row.skipped > 0, row.pattern
            assert row.computed + row.skipped == STEPS
            assert psnr(ours, reference) > 35, row.pattern

    def test_seeded_weights_never_skip(self) -> None:
        """Without the smoothing a first-block cache computes every step (why it exists)."""
        loader = TinyDitLoader(TinyDitOptions(seed=7))
        loader.cache = FIRST_BLOCK
        with component_attention_scope(
            ComponentRequests(component="transformer"), platform=Platform("cpu")
        ):
            module = loader.build("custom")
        arm_layers(module)
        generator = torch.Generator().manual_seed(0)
        batch = Batch(generator=generator, steps=STEPS, size=2, guidance_scale=4.0)
        batch.context = [torch.randn(3, 32, generator=generator) for _ in range(2)]
        with torch.inference_mode():
            loader.run(module, batch)
        assert [row.skipped for row in caches(batch)] == [0, 0]

    def test_taylor_seer_follows_its_schedule(self) -> None:
        """Warm-up, every third step after it, and the final step are computed; the rest
        predicted."""
        (row,) = caches(denoise(TAYLOR_SEER, (16,)))
        assert row.pattern == "CCSSCSSCSSCSSCSC"

    @pytest.mark.parametrize("settings", [FIRST_BLOCK, TAYLOR_SEER], ids=["first_block", "taylor"])
    def test_each_row_equals_itself_alone(self, settings: CacheSettings) -> None:
        """Rows of three sizes, one of them uncached, decide for themselves: each one's
        latents and skip pattern equal the request run alone (1e-5, float32)."""
        flags = [True, False, True]
        batched = denoise(settings, cache=flags)
        patterns = [None if row is None else row.pattern for row in batched.cache_rows or []]
        assert patterns[1] is None
        assert batched.cache_rows is not None
        for i, (tokens, flag) in enumerate(zip(TOKENS, flags, strict=True)):
            alone = denoise(settings, (tokens,), cache=flag)
            assert (alone.latents or [])[0].shape == (batched.latents or [])[i].shape
            assert torch.allclose((alone.latents or [])[0], (batched.latents or [])[i], atol=1e-5)
            alone_rows = alone.cache_rows
            assert alone_rows is not None
            assert (None if alone_rows[0] is None else alone_rows[0].pattern) == patterns[i]
        assert "S" in str(patterns[0]) + str(patterns[2])

    def test_uncached_rows_compute_like_no_cache(self) -> None:
        """A batch whose rows all set ``cache = False`` runs no cache: bit for bit uncached."""
        off = denoise(FIRST_BLOCK, cache=False)
        uncached = denoise(None)
        assert off.cache_rows == [None, None, None]
        for ours, reference in zip(off.latents or [], uncached.latents or [], strict=True):
            assert torch.equal(ours, reference)

    def test_a_short_request_runs_uncached_and_says_so(self) -> None:
        """Three steps with a warm-up of 2 and a final step: every step computed, the reason
        kept, the latents bit for bit the uncached run's."""
        short = denoise(FIRST_BLOCK, steps=3)
        uncached = denoise(None, steps=3)
        for row in caches(short):
            assert row.pattern == "CCC"
            assert row.uncached is not None
            assert "3 steps leave nothing to skip" in row.uncached
        for ours, reference in zip(short.latents or [], uncached.latents or [], strict=True):
            assert torch.equal(ours, reference)

    def test_tensors_are_freed_with_the_stage(self) -> None:
        """A row's kept tensors are dropped when its denoising ends; its decisions stay."""
        for row in caches(denoise(FIRST_BLOCK, (9,))):
            assert row.branches == {}
            assert len(row.decisions) == STEPS

    def test_a_cancelled_row_leaves_with_its_cache(self) -> None:
        """A row cancelled after step 5 leaves the batch and its cache; the others equal
        themselves alone."""
        loader, module, batch = seeded(FIRST_BLOCK)

        def cancel_at_five(done: object) -> None:
            if batch.step == 5:
                batch.cancellation.cancel("middle", [1])

        batch.on_step = cancel_at_five
        with torch.inference_mode():
            loader.run(module, batch)
        assert batch.rows == [0, 2]
        assert len(caches(batch)) == 2
        for position, row in enumerate((0, 2)):
            alone = denoise(FIRST_BLOCK, (TOKENS[row],))
            assert torch.allclose(
                (alone.latents or [])[0], (batch.latents or [])[position], atol=1e-5
            )
            assert caches(alone)[0].pattern == caches(batch)[position].pattern
