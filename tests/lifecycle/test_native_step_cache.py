"""A step cache on the native path: diffusers' own first-block hook, each row deciding alone.

The folder is the tiny Flux one written with ``smooth_time=True``
(``benchmarks.make_pipeline --smooth-time``): its timestep MLP reads only the slow half
of its frequencies, so that adjacent steps differ as a trained model's do and a cache
has steps to skip. Every run here asserts that it skipped some. Diffusers' Flux class
has the hook (``CacheMixin``); PixArt's has none (``test_step_caches``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from components.batch import Batch
from components.cache import CacheSettings
from tests.components.folder_runs import Request, call_pipeline, load, run_batch
from tests.conftest import Lifecycle, PipelineFolders
from tests.lifecycle.cache_rows import assert_each_row_alone

pytestmark = pytest.mark.usefixtures("one_thread")

THRESHOLD = 0.08
NATIVE = '[components.transformer]\nloader = "native"\n'
HOOKED = 'method = "first_block"\nwarmup_steps = 1\nfinal_steps = 0\n'
"""The settings diffusers' FirstBlockCache runs as written: it computes the first step
only, then may skip any step, any number in a row."""
REQUEST = Request(steps=28, size=(64, 64), guidance_scale=3.5)


@pytest.fixture(scope="module")
def flux(pipeline_folder: PipelineFolders) -> Path:
    """The tiny Flux folder whose steps differ as a trained model's do."""
    return pipeline_folder("flux", smooth_time=True)


def native_spec(folder: Path, into: Path, cache: str) -> Path:
    """Write a spec over ``folder`` whose transformer loads natively with ``cache`` (the
    lines of its cache table) and return its path."""
    path = into / "native.toml"
    path.write_text(
        f'source = "{folder}"\ndevice = "cpu"\n{NATIVE}[components.transformer.cache]\n{cache}'
    )
    return path


def hook_states(module: Any) -> dict[str, Any]:
    """Return the hook's state per cache context, as diffusers keeps it on the first block."""
    leader = module.transformer_blocks[0]._diffusers_hook.hooks["fbc_leader_block_hook"]
    states: dict[str, Any] = leader.state_manager._state_cache
    return states


def cached_batch(rows: list[int], flags: list[bool], latents: list[torch.Tensor]) -> Batch:
    """Return a batch of ``REQUEST`` for ``rows``, each with its own noise and cache flag."""
    return Batch(
        generator=torch.Generator().manual_seed(0),
        steps=REQUEST.steps,
        size=len(rows),
        prompts=[f"a fox, number {row}" for row in rows],
        guidance_scale=REQUEST.guidance_scale,
        image_size=REQUEST.size,
        latents=[latents[row] for row in rows],
        cache=[flags[row] for row in rows],
    )


class TestNativeRuns:
    """Diffusers' Flux class under its own hook: skips counted, equal to diffusers."""

    def test_run_json_counts_the_hooks_skips(
        self, flux: Path, lifecycle: Lifecycle, tmp_path: Path
    ) -> None:
        """``run --json`` of a native Flux with first_block counts every step, some skipped."""
        spec = native_spec(flux, tmp_path, HOOKED)
        result = lifecycle(
            "run", spec, "--json", "--requests", "1", "--threads", "1", "--size", "64x64",
            "--prompt", "a red fox in the snow",
        )  # fmt: skip
        assert result.returncode == 0, result.stderr
        component = json.loads(result.stdout)["summary"]["components"]["transformer"]
        counted = component["cache"]
        assert counted["computed"] + counted["skipped"] == 28
        assert counted["skipped"] > 0, counted

    def test_equals_diffusers_flux_pipeline_with_its_hook(self, flux: Path) -> None:
        """The image equals diffusers' FluxPipeline with
        ``enable_cache(FirstBlockCacheConfig(threshold))`` on the same folder (1e-5), with
        steps skipped, and the hook keeps no state once the request is done."""
        from diffusers import DiffusionPipeline
        from diffusers.hooks.first_block_cache import FirstBlockCacheConfig

        loaded = load(flux)
        transformer = loaded.loaders["transformer"]
        transformer.cache = CacheSettings(
            method="first_block", warmup_steps=1, final_steps=0, threshold=THRESHOLD
        )
        batch = Batch(
            generator=torch.Generator("cpu").manual_seed(REQUEST.seed),
            steps=REQUEST.steps,
            size=1,
            prompts=[REQUEST.prompt],
            guidance_scale=REQUEST.guidance_scale,
            image_size=REQUEST.size,
        )
        ours = run_batch(loaded, batch)
        (row,) = batch.cache_rows or [None]
        assert row is not None
        assert row.skipped > 0, row.pattern
        assert hook_states(loaded.modules["transformer"]) == {}

        pipeline = DiffusionPipeline.from_pretrained(str(flux), torch_dtype=torch.float32)
        pipeline.transformer.enable_cache(FirstBlockCacheConfig(threshold=THRESHOLD))
        theirs = call_pipeline(pipeline, REQUEST)
        assert torch.allclose(ours, theirs, atol=1e-5), (ours - theirs).abs().max()

    def test_two_rows_with_different_flags_each_equal_alone(self, flux: Path) -> None:
        """A batch of a cached and an uncached request: each image's latents equal its
        request alone (1e-5), the cached one with the same skips, the other with none."""
        loaded = load(flux)
        loaded.loaders["transformer"].cache = CacheSettings(
            method="first_block", warmup_steps=0, final_steps=0, threshold=THRESHOLD
        )
        recipe = loaded.recipe
        latents = [
            recipe.draw_latents(torch.Generator().manual_seed(row), 1, REQUEST.size)[0]
            for row in range(2)
        ]
        flags = [True, False]

        def run(rows: list[int]) -> Batch:
            batch = cached_batch(rows, flags, latents)
            run_batch(loaded, batch)
            assert hook_states(loaded.modules["transformer"]) == {}
            return batch

        assert_each_row_alone(run, flags)


class TestNativeRefusals:
    """What diffusers' hook cannot do as written is refused by ``check``, naming the fix."""

    @pytest.mark.parametrize(
        ("table", "named"),
        [
            ('method = "taylor_seer"', 'method = "first_block"'),
            ('method = "first_block"\nfinal_steps = 0', "warmup_steps = 1 (it is 2"),
            ('method = "first_block"\nwarmup_steps = 0', "final_steps = 0 (it is 1"),
            (HOOKED + "max_skipped = 3", "no max_skipped (it is 3"),
        ],
    )
    def test_settings_the_hook_cannot_run_are_refused(
        self, table: str, named: str, flux: Path, lifecycle: Lifecycle, tmp_path: Path
    ) -> None:
        """taylor_seer, a warm-up above 1, final steps or max_skipped on the native path
        are ``acceleration.cache_unsupported``, naming the key, the value diffusers can do
        and the custom loader."""
        result = lifecycle("check", "--json", native_spec(flux, tmp_path, table + "\n"))
        assert result.returncode == 1, result.stdout
        (refusal,) = json.loads(result.stdout)["refusals"]
        assert (refusal["code"], refusal["component"]) == (
            "acceleration.cache_unsupported",
            "transformer",
        )
        assert named in refusal["message"]
        assert 'loader = "custom"' in refusal["hint"]

    def test_the_settings_the_hook_runs_are_admitted(
        self, flux: Path, lifecycle: Lifecycle, tmp_path: Path
    ) -> None:
        """first_block with warmup_steps = 1 and final_steps = 0 is admitted natively."""
        result = lifecycle("check", "--json", native_spec(flux, tmp_path, HOOKED))
        assert result.returncode == 0, result.stdout
        component = json.loads(result.stdout)["components"]["transformer"]
        assert component["cache"]["method"] == "first_block"
