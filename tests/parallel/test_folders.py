"""A pipeline from a folder under replicated layouts: data and CFG parallel on two ranks."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.components.folder_runs import Request, run_diffusers
from tests.conftest import Lifecycle, PipelineFolders, decode_png
from tests.lifecycle.folder_specs import assert_same_pixels, pixels, run_arguments

pytestmark = pytest.mark.long

REQUEST = Request(negative_prompt="blurry", size=(32, 32), steps=2, seed=5)
NATIVE = "".join(
    f'\n[components.{name}]\nloader = "native"' for name in ("text_encoder", "transformer", "vae")
)


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize(
    "layout",
    # two processes that import diffusers take most of a minute here: CFG, which runs the
    # same replicated path, is left to `make test-slow`. Only diffusers' classes take CFG
    # parallel (no custom kind splits the guidance branches), so that case asks for them.
    ["dp_size = 2", pytest.param("cfg_parallel = true" + NATIVE, marks=pytest.mark.slow)],
)
def test_replicated_layouts_make_diffusers_images(
    layout: str, pipeline_folder: PipelineFolders, tmp_path: Path, lifecycle_fd: Lifecycle
) -> None:
    """``--nproc 2`` runs the components replicated; rank 0 writes diffusers' image."""
    folder = pipeline_folder("pixart-sigma")
    spec = tmp_path / "spec.toml"
    spec.write_text(f'source = "{folder}"\ndevice = "cpu"\n[parallel]\n{layout}\n')
    out = tmp_path / "out"
    arguments = [*run_arguments(REQUEST), "--requests", "2", "--out", out]
    result = lifecycle_fd("run", spec, "--nproc", "2", *arguments)
    assert result.returncode == 0, result.stderr[-3000:]
    written = sorted(path.name for path in out.iterdir())
    # data parallel: rank 0 runs requests 1 (and 3, ...); CFG parallel: every request
    assert written == (["r1-0.png"] if layout.startswith("dp") else ["r1-0.png", "r2-0.png"])
    assert_same_pixels(
        decode_png((out / "r1-0.png").read_bytes()), pixels(run_diffusers(folder, REQUEST))[0]
    )
