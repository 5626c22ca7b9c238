"""T5's custom path split by heads and feed-forward units (DTensor) equals one process."""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
import pytest
import torch

from components.folders.pipeline import FolderPipeline
from lifecycle import AdmissionRefused, Orchestrator
from lifecycle.config import load_spec
from tests.conftest import PipelineFolders
from tests.parallel.t5_worker import encode
from tests.processes import run_python

# Float32, max|split - alone| / max|alone|, as every layout states (tests/parallel/test_layouts).
TOLERANCE = 1e-5


def write_spec(folder: Path, into: Path, tp_size: int) -> Path:
    """Write a spec of ``folder``'s T5 alone, resident, with ``tp_size``; return its path."""
    plan = FolderPipeline.read(folder).components["text_encoder"]
    table = {
        "name": "t5-tp",
        "device": "cpu",
        "parallel": {"tp_size": tp_size, "timeout_s": 30},
        "components": {"text_encoder": {"kind": plan.kind, "options": plan.options}},
    }
    path = into / f"t5_tp{tp_size}.json"
    path.write_bytes(msgspec.json.encode(table))
    return path


class TestTensorParallel:
    """Two gloo ranks under torchrun against one process, on PixArt's T5."""

    def test_two_ranks_equal_one_process(
        self, pipeline_folder: PipelineFolders, tmp_path: Path, root: Path
    ) -> None:
        """Masked and unmasked states equal one process's; each rank holds about half."""
        folder = pipeline_folder("pixart")
        result = run_python(
            "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
            "tests/parallel/t5_worker.py", write_spec(folder, tmp_path, 2), tmp_path,
            cwd=root, module=True,
        )  # fmt: skip
        assert result.returncode == 0, result.stderr[-3000:]
        split: list[torch.Tensor] = torch.load(tmp_path / "states.pt")
        alone, whole = encode(write_spec(folder, tmp_path, 1))
        for got, want in zip(split, alone, strict=True):
            assert got.shape == want.shape
            assert ((got - want).abs().max() / want.abs().max()).item() < TOLERANCE
        for rank in (0, 1):
            held = json.loads((tmp_path / f"rank{rank}.json").read_text())["held_bytes"]
            assert held < 0.75 * whole  # the heads and feed-forward units are halved

    def test_heads_must_divide_by_the_tp_degree(
        self, pipeline_folder: PipelineFolders, tmp_path: Path
    ) -> None:
        """tp_size 3 against T5's 4 heads is refused at admission, naming the heads."""
        spec = load_spec(write_spec(pipeline_folder("pixart"), tmp_path, 3))
        with pytest.raises(AdmissionRefused) as refused, Orchestrator(spec) as pipeline:
            pipeline.admit()
        codes = {refusal.code for refusal in refused.value.refusals}
        assert codes == {"parallel.invalid_layout"}
        assert "4 heads" in str(refused.value)
