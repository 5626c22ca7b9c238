"""The encoders' custom paths split over ranks equal one process: T5 by tensor parallel
(DTensor), T5, CLIP and the VAE sharded by FSDP2."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest
import torch

from benchmarks.make_pipeline import Family
from components.recipes.folder import FolderPipeline
from lifecycle import AdmissionRefused, Orchestrator
from lifecycle.spec.reading import load_spec
from tests.conftest import PipelineFolders
from tests.parallel.encoders_worker import run_rank, run_spec
from tests.ranks import TOKENIZERS, run_ranks

pytestmark = pytest.mark.long

# Float32, max|split - alone| / max|alone|, as every layout states (tests/parallel/test_layouts).
TOLERANCE = 1e-5
DEADLINE_S = 300.0

ENCODERS: dict[str, tuple[Family, str]] = {
    "t5": ("pixart", "text_encoder"),
    "clip": ("flux", "text_encoder"),
    "clip_projected": ("sd3", "text_encoder"),
    "vae": ("pixart", "vae"),
}
SEQUENCE_SPLIT_DIT = {"kind": "tiny_dit", "options": {"seed": 7}}
"""A DiT split by Ulysses: it makes the replica two ranks, which FSDP shards over."""
LAYOUTS: dict[str, tuple[tuple[str, ...], dict[str, object]]] = {
    "tp": (("t5",), {"tp_size": 2}),
    "fsdp": (tuple(ENCODERS), {"sp_degree": 2, "ulysses_degree": 2, "fsdp": list(ENCODERS)}),
}


def write_spec(
    folders: PipelineFolders, into: Path, name: str, *, split: bool, **component: object
) -> Path:
    """Write layout ``name``'s spec (``split``: with its ``[parallel]``, else one process)."""
    names, parallel = LAYOUTS[name]
    components: dict[str, object] = {}
    for key in names:
        family, inside = ENCODERS[key]
        plan = FolderPipeline.read(folders(family)).components[inside]
        components[key] = {"kind": plan.kind, "options": plan.options, **component}
    if split and "fsdp" in parallel:
        components["transformer"] = SEQUENCE_SPLIT_DIT
    table = {
        "name": f"encoders-{name}",
        "device": "cpu",
        "parallel": {**(parallel if split else {}), "timeout_s": 30},
        "components": components,
    }
    path = into / f"{name}{'' if split else '_alone'}.json"
    path.write_bytes(msgspec.json.encode(table))
    return path


@pytest.fixture(scope="module")
def two_ranks(pipeline_folder: PipelineFolders, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Every layout's outputs and held bytes from one spawn of two gloo ranks."""
    out = tmp_path_factory.mktemp("encoders")
    specs = [str(write_spec(pipeline_folder, out, name, split=True)) for name in LAYOUTS]
    exits = run_ranks(run_rank, 2, out, str(out), specs, deadline_s=DEADLINE_S, preload=TOKENIZERS)
    assert exits == [0, 0], f"rank exit codes {exits} (tracebacks on stderr)"
    return out


class TestTwoRanks:
    """Two gloo ranks against one process, on the tiny folders."""

    @pytest.mark.parametrize("layout", list(LAYOUTS))
    def test_equal_to_one_process_holding_about_half(
        self, layout: str, two_ranks: Path, pipeline_folder: PipelineFolders, tmp_path: Path
    ) -> None:
        """Every output equals one process's; each rank holds under 3/4 of the weights."""
        split: dict[str, list[torch.Tensor]] = torch.load(two_ranks / f"{layout}.pt")
        alone = run_spec(write_spec(pipeline_folder, tmp_path, layout, split=False))
        assert split.keys() == alone.keys() == set(LAYOUTS[layout][0])
        for name, ran in alone.items():
            for got, want in zip(split[name], ran.outputs, strict=True):
                assert got.shape == want.shape
                assert ((got - want).abs().max() / want.abs().max()).item() < TOLERANCE, name
            for rank in (0, 1):
                path = two_ranks / f"{layout}.rank{rank}.json"
                held = msgspec.json.decode(path.read_bytes(), type=dict[str, int])[name]
                assert held < 0.75 * ran.held_bytes, f"{name} on rank {rank} holds {held}"


class TestAdmission:
    """What a layout cannot do with the encoders is refused before anything loads."""

    def test_heads_must_divide_by_the_tp_degree(
        self, pipeline_folder: PipelineFolders, tmp_path: Path
    ) -> None:
        """tp_size 3 against T5's 4 heads is refused at admission, naming the heads."""
        path = write_spec(pipeline_folder, tmp_path, "tp", split=True)
        raw = msgspec.json.decode(path.read_bytes())
        raw["parallel"]["tp_size"] = 3
        path.write_bytes(msgspec.json.encode(raw))
        with pytest.raises(AdmissionRefused) as refused, Orchestrator(load_spec(path)) as pipeline:
            pipeline.admit()
        codes = {refusal.code for refusal in refused.value.refusals}
        assert codes == {"parallel.invalid_layout"}
        assert "4 heads" in str(refused.value)

    @pytest.mark.parametrize("layout", list(LAYOUTS))
    def test_native_path_cannot_split(
        self, layout: str, pipeline_folder: PipelineFolders, tmp_path: Path
    ) -> None:
        """loader = "native" under a splitting layout is loader.native_parallel_layout."""
        path = write_spec(pipeline_folder, tmp_path, layout, split=True, loader="native")
        with pytest.raises(AdmissionRefused) as refused, Orchestrator(load_spec(path)) as pipeline:
            pipeline.admit()
        refusals = refused.value.refusals
        assert {r.code for r in refusals} == {"loader.native_parallel_layout"}
        assert {r.component for r in refusals} == set(LAYOUTS[layout][0])
