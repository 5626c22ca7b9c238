"""``python -m benchmarks.make_pipeline``: real diffusers folders with seeded weights, offline."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest

from benchmarks.make_pipeline import Family
from tests.conftest import PipelineFolders
from tests.processes import run_python

pytestmark = pytest.mark.usefixtures("one_thread")


def weights(folder: Path) -> bytes:
    """Return the bytes of the transformer's weights file in pipeline ``folder``."""
    return (folder / "transformer" / "diffusion_pytorch_model.safetensors").read_bytes()


class TestMakePipeline:
    """The command writes a folder diffusers reads; the seed alone decides the weights."""

    def test_command_writes_a_folder(
        self, pipeline_folder: PipelineFolders, tmp_path: Path, capsys: pytest.CaptureFixture[str]
    ) -> None:
        """The command prints the folder it wrote and no progress bar; the same seed writes
        the same weights.

        Its ``main`` runs here, where diffusers is imported already; the unknown family
        runs the command as a process of its own.
        """
        from transformers.utils import logging

        from benchmarks.make_pipeline import main

        assert logging.is_progress_bar_enabled()
        main(["flux", str(tmp_path / "f")])
        printed = capsys.readouterr()
        assert printed.out == f"{tmp_path / 'f'}\n"
        assert "Writing model shards" not in printed.err  # transformers' bar, two encoders
        assert logging.is_progress_bar_enabled()  # off for the save only
        index = json.loads((tmp_path / "f" / "model_index.json").read_text())
        assert index["_class_name"] == "FluxPipeline"
        assert index["tokenizer_2"][0] == "transformers"
        assert weights(tmp_path / "f") == weights(pipeline_folder("flux"))

    def test_another_seed_writes_other_weights(
        self, pipeline_folder: PipelineFolders, tmp_path: Path
    ) -> None:
        """A different seed draws different weights into the same layout."""
        from benchmarks.make_pipeline import write_pipeline

        other = write_pipeline("sd3", tmp_path / "sd3", seed=1)
        assert weights(other) != weights(pipeline_folder("sd3"))
        assert len(weights(other)) == len(weights(pipeline_folder("sd3")))

    def test_unknown_family_is_bad_input(self, root: Path, tmp_path: Path) -> None:
        """A family the command does not make is exit 2 with the choices."""
        result = run_python("benchmarks.make_pipeline", "sdxl", tmp_path, cwd=root, module=True)
        assert result.returncode == 2
        assert (
            "invalid choice: 'sdxl' (choose from 'pixart', 'pixart-sigma', 'flux', 'sd3', "
            "'qwen-image', 'z-image', 'flux2-klein', 'flux2-klein-distilled', 'wan', 'wan-a14b', "
            "'wan-ti2v', 'wan-i2v', 'wan-i2v-a14b')" in result.stderr
        )


def first_block_changes(folder: Path, steps: int) -> list[float]:
    """Return the first DiT block's relative L1 change, step to step, over one request.

    The change of step ``s`` is ``mean|r_s - r_(s-1)| / mean|r_(s-1)|`` of the block's
    output residual ``r`` (its image rows' output minus their input), what a
    first-block cache compares with its threshold.
    """
    import torch

    from tests.components.folder_runs import Request, load, run_recipe

    loaded = load(folder)
    block = loaded.modules["transformer"].transformer_blocks[0]
    residuals: list[torch.Tensor] = []

    def keep(
        module: object, args: tuple[object, ...], kwargs: dict[str, object], out: object
    ) -> None:
        image = kwargs.get("hidden_states", args[0] if args else None)
        output = out[1] if isinstance(out, tuple) else out  # Flux returns (text, image)
        assert isinstance(image, torch.Tensor)
        assert isinstance(output, torch.Tensor)
        residuals.append(output - image)

    block.register_forward_hook(keep, with_kwargs=True)
    run_recipe(loaded, Request(steps=steps, guidance_scale=1.0))
    return [
        float((now - before).abs().mean() / before.abs().mean())
        for before, now in itertools.pairwise(residuals)
    ]


@pytest.mark.parametrize("family", ["pixart", "flux"])
def test_smooth_time_makes_steps_differ_as_trained_ones(
    family: Family, pipeline_folder: PipelineFolders
) -> None:
    """``--smooth-time`` brings the first block's step-to-step change from ~0.5 to ~0.06.

    Measured on the tiny folders over 20 steps (median): PixArt 0.48 -> 0.07, Flux 0.76
    -> 0.08; the bench folders 0.32 -> 0.04 and 0.55 -> 0.05 (``smooth_time_embedding``).
    """
    import statistics

    seeded = first_block_changes(pipeline_folder(family), 20)
    smooth = first_block_changes(pipeline_folder(family, smooth_time=True), 20)
    assert statistics.median(seeded) > 0.25, seeded
    assert statistics.median(smooth) < 0.12, smooth
