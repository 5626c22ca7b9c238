"""The real DiTs on their custom path split as the layouts say, equal to one process.

PixArt and Flux run every layout; SD3, whose joint attention and sharding are Flux's
(``JointLayout``), adds the two that exercise its own code: Ulysses over its blocks
(the last reads a text shard without updating it) and its tensor-parallel plan;
Qwen-Image, Flux's blocks under its own text mask and per-axis rotary, runs every
two-rank layout, and so does Z-Image, whose refiners shard each request's image and
text apart before its main layers shard them together (tensor parallel splits the tiny
folder's 85 feed-forward units unevenly, 43 and 42); Wan runs Ulysses, ring, K/V
gather and tensor parallel over videos of 1 to 3 frames. One
spawn of two gloo processes and one of four each run every case of their size; the
parent compares rank 0's outputs with the DiT run alone on the same seeded groups:
requests of three sizes and prompt lengths, packed so that shard boundaries cut
requests apart.
"""

from __future__ import annotations

import functools
import itertools
import json
from pathlib import Path

import msgspec
import pytest
import torch

from attention import Platform
from components.models.dit.z_image import feed_forward_units
from components.weights import seed_weights
from lifecycle.admission import admit_pipeline
from lifecycle.spec.reading import decode_spec
from tests.components.dit_inputs import KINDS, MIXED
from tests.conftest import PipelineFolders
from tests.parallel.dit_worker import DitCase, run_dit_alone, run_dit_case
from tests.parallel.layout_worker import Ran, Sent
from tests.parallel.test_layouts import spawn

pytestmark = pytest.mark.long

# Float32, max|split - alone| / max|alone| per group, as for the tiny DiT's layouts.
TOLERANCE = 1e-5
FAMILIES = ("pixart", "flux")
SD3_TWO = ("ulysses", "tensor_parallel")
"""The two-rank layouts SD3 runs too."""
LATER = {
    "sd3": SD3_TWO,
    "qwen-image": ("ulysses", "ring", "kv_gather", "tensor_parallel", "fsdp"),
    "z-image": ("ulysses", "ring", "kv_gather", "tensor_parallel", "fsdp"),
    "wan": ("ulysses", "ring", "kv_gather", "tensor_parallel"),
}
"""The families that run some two-rank layouts only (SD3 also the sweeps; Wan over
requests of three frame counts)."""
TWO = {
    "ulysses": ("sp_degree = 2\nulysses_degree = 2", False),
    "ring": ("sp_degree = 2\nring_degree = 2", False),
    "kv_gather": ("sp_degree = 2\nkv_gather_degree = 2", False),
    "tensor_parallel": ("tp_size = 2", True),
    "fsdp": ('sp_degree = 2\nulysses_degree = 2\nfsdp = ["transformer"]', True),
}
FOUR = {
    "ulysses_x_ring": ("sp_degree = 4\nulysses_degree = 2\nring_degree = 2", False),
    "tp_x_ulysses": ("tp_size = 2\nsp_degree = 2\nulysses_degree = 2", True),
}
SENT = {
    "ulysses": {"all_to_all", "output_gather"},
    "ring": {"ring", "output_gather"},
    "kv_gather": {"all_gather", "output_gather"},
    "tensor_parallel": set(),  # DTensor's all-reduce, not attention traffic
    "fsdp": {"all_to_all", "output_gather"},
    "ulysses_x_ring": {"all_to_all", "ring", "output_gather"},
    "tp_x_ulysses": {"all_to_all", "output_gather"},
}
SHARDS_WEIGHTS = ("tensor_parallel", "fsdp", "tp_x_ulysses")
SWEPT = ("ulysses", "ring", "kv_gather")
"""The sequence-parallel layouts every family runs the prompt-length sweep under."""


WIDE = ("tp_x_ulysses",)
"""Layouts that split the heads four ways: they run a copy of the DiT with four heads."""


def cases(layouts: dict[str, tuple[str, bool]], folders: dict[str, Path]) -> dict[str, DitCase]:
    """Return every (family, layout) case, named ``family-layout`` (``LATER``: its own), and
    every family's sweep under each layout of ``SWEPT``, named ``family-layout-sweep``."""
    pairs = [
        *itertools.product(FAMILIES, layouts),
        *((f, n) for f, names in LATER.items() for n in names if n in layouts),
    ]
    found = {
        f"{family}-{name}": DitCase(
            family=family,
            folder=str(folders[f"{family}-wide" if name in WIDE else family]),
            layout=layouts[name][0],
            direct=layouts[name][1],
        )
        for family, name in pairs
    }
    for family, name in itertools.product((*FAMILIES, "sd3"), SWEPT):
        if name in layouts:
            found[f"{family}-{name}-sweep"] = DitCase(
                family=family, folder=str(folders[family]), layout=layouts[name][0], sweep=True
            )
    return found


CACHED = {
    "pixart-ulysses-cache": ("pixart", "ulysses", "taylor_seer"),
    "flux-ulysses-cache": ("flux", "ulysses", "first_block"),
    "flux-ring-cache": ("flux", "ring", "taylor_seer"),
}
"""Cases of a step cache under sequence parallel, on the smoothed folders: family,
layout, method."""


def cached_cases(folders: dict[str, Path]) -> dict[str, DitCase]:
    """Return the ``CACHED`` cases."""
    return {
        name: DitCase(
            family=family,
            folder=str(folders[f"{family}-smooth"]),
            layout=TWO[layout][0],
            cache=method,
        )
        for name, (family, layout, method) in CACHED.items()
    }


def with_heads(folder: Path, into: Path, heads: int) -> Path:
    """Write a seeded copy of ``folder``'s DiT with ``heads`` heads of the same width each."""
    config = json.loads((folder / "transformer" / "config.json").read_text())
    changes = {"num_attention_heads": heads}
    if "cross_attention_dim" in config:  # PixArt attends its text at the model's width
        changes["cross_attention_dim"] = heads * config["attention_head_dim"]
    return with_config(folder, into, changes)


def with_config(folder: Path, into: Path, changes: dict[str, object]) -> Path:
    """Write a copy of ``folder``'s DiT with ``changes`` to its config, its weights seeded as
    the folders' are (pads and gains too, which diffusers starts at zeros and ones)."""
    import diffusers

    config = json.loads((folder / "transformer" / "config.json").read_text())
    model = getattr(diffusers, config["_class_name"]).from_config(config | changes)
    seed_weights(model, 0)
    model.save_pretrained(str(into / "transformer"))
    return into


@pytest.fixture(scope="module")
def folders(
    pipeline_folder: PipelineFolders, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Path]:
    """The tiny folders (and four-head copies), written before any rank starts."""
    found = {family: pipeline_folder(family) for family in (*FAMILIES, *LATER)}
    found |= {f"{f}-smooth": pipeline_folder(f, smooth_time=True) for f in FAMILIES}
    for family in FAMILIES:
        found[f"{family}-wide"] = with_heads(found[family], tmp_path_factory.mktemp(family), 4)
    return found


@pytest.fixture(scope="module")
def two(folders: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Every two-rank case's outputs, from one spawn of two gloo processes."""
    out_dir = tmp_path_factory.mktemp("dit_two")
    spawn(2, cases(TWO, folders) | cached_cases(folders), out_dir, run_dit_case)
    return out_dir


@pytest.fixture(scope="module")
def four(folders: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Every four-rank case's outputs, from one spawn of four gloo processes."""
    out_dir = tmp_path_factory.mktemp("dit_four")
    spawn(4, cases(FOUR, folders), out_dir, run_dit_case)
    return out_dir


@functools.cache
def dit_alone(
    folder: str, family: str, packed: bool, sweep: bool, cache: str = ""
) -> tuple[Ran, int]:
    """Run a folder's DiT alone once: every layout of it compares with the same outputs."""
    return run_dit_alone(
        DitCase(family=family, folder=folder, packed=packed, sweep=sweep, cache=cache)
    )


def assert_equal_to_alone(out_dir: Path, name: str, case: DitCase, world: int) -> None:
    """Assert rank 0's outputs equal one process's, and what each rank sent and held."""
    split: list[torch.Tensor] = torch.load(out_dir / f"{name}.pt")
    ran, block_bytes = dit_alone(case.folder, case.family, case.packed, case.sweep, case.cache)
    alone, alone_bytes = ran.outputs, ran.held_bytes
    assert len(split) == len(alone)
    for got, want in zip(split, alone, strict=True):
        assert got.shape == want.shape
        error = ((got - want).abs().max() / want.abs().max()).item()
        assert error < TOLERANCE, f"{name}: relative error {error}"
    layout = name.removeprefix(f"{case.family}-").split("-")[0]
    for rank in range(world):
        did = msgspec.json.decode((out_dir / f"{name}.rank{rank}.json").read_bytes(), type=Sent)
        assert set(did.sent) == SENT[layout], f"{name} rank {rank} sent {did.sent}"
        assert all(count > 0 for count in did.sent.values())
        if layout in SHARDS_WEIGHTS:
            # TP halves the blocks' projections, FSDP every weight: at least a quarter of
            # the blocks' bytes leave each rank (SD3's stored position table stays whole)
            held = did.held_bytes
            assert held < alone_bytes - block_bytes / 4, f"{name} rank {rank} holds {did}"


class TestTwoRanks:
    """Ulysses, ring, K/V gather, tensor parallel and FSDP on two processes."""

    @pytest.mark.parametrize(
        "name",
        [
            *(f"{f}-{n}" for f in FAMILIES for n in TWO),
            *(f"{f}-{n}" for f, names in LATER.items() for n in names),
        ],
    )
    def test_layout_equals_one_process(
        self, two: Path, folders: dict[str, Path], name: str
    ) -> None:
        """The split DiT's output equals the one-process output within 1e-5."""
        assert_equal_to_alone(two, name, cases(TWO, folders)[name], 2)

    def test_z_image_splits_its_feed_forward_unevenly(
        self, two: Path, folders: dict[str, Path]
    ) -> None:
        """Tensor parallel splits the tiny Z-Image folder's 85 feed-forward units 43 and 42:
        rank 0 holds one more unit of w1, w2 and w3 in every block than rank 1."""
        config = json.loads((folders["z-image"] / "transformer" / "config.json").read_text())
        dim = config["dim"]
        assert feed_forward_units(dim) % 2 == 1
        held = [
            msgspec.json.decode(
                (two / f"z-image-tensor_parallel.rank{rank}.json").read_bytes(), type=Sent
            ).held_bytes
            for rank in range(2)
        ]
        blocks = 2 * config["n_refiner_layers"] + config["n_layers"]
        assert held[0] - held[1] == blocks * 3 * dim * 4  # float32

    @pytest.mark.parametrize("name", [f"{f}-{n}-sweep" for f in (*FAMILIES, "sd3") for n in SWEPT])
    def test_every_split_equals_one_process(
        self, two: Path, folders: dict[str, Path], name: str
    ) -> None:
        """Every prompt length and image size, wherever the shard boundary falls (a shard
        without text or image rows, a request wholly in one shard), equals one process."""
        assert_equal_to_alone(two, name, cases(TWO, folders)[name], 2)


@pytest.mark.usefixtures("one_thread")
class TestCachedLayouts:
    """A step cache on the folder DiTs under sequence parallel: each part of the stack
    gathers its rows whole, so both ranks decide alike."""

    @pytest.mark.parametrize("name", list(CACHED))
    def test_ranks_skip_alike_and_equal_one_process(
        self, two: Path, folders: dict[str, Path], name: str
    ) -> None:
        """Ten steps of requests of three sizes: both ranks skip the steps one process does,
        and every step's output equals one process's within 1e-5."""
        case = cached_cases(folders)[name]
        assert_equal_to_alone(two, name, case, 2)
        patterns = dit_alone(case.folder, case.family, case.packed, case.sweep, case.cache)[0]
        assert any("S" in pattern for pattern in patterns.patterns), patterns.patterns
        for rank in range(2):
            did = msgspec.json.decode((two / f"{name}.rank{rank}.json").read_bytes(), type=Sent)
            assert tuple(did.patterns) == patterns.patterns, f"{name} rank {rank}"


class TestFourRanks:
    """Ulysses x ring and tensor parallel x Ulysses on four processes."""

    @pytest.mark.parametrize("name", [f"{f}-{n}" for f in FAMILIES for n in FOUR])
    def test_layout_equals_one_process(
        self, four: Path, folders: dict[str, Path], name: str
    ) -> None:
        """The split DiT's output equals the one-process output within 1e-5."""
        assert_equal_to_alone(four, name, cases(FOUR, folders)[name], 4)


def test_shards_cut_requests_apart() -> None:
    """The inputs make shard boundaries (2 and 4 shards) fall inside requests of every family
    (Wan's: inside the frames of a video)."""
    for family, text_of, frames_of in (
        ("pixart", lambda r: 0, lambda r: 1),
        ("flux", lambda r: r.text, lambda r: 1),
        ("sd3", lambda r: r.text, lambda r: 1),
        ("qwen-image", lambda r: r.text, lambda r: 1),
        ("wan", lambda r: 0, lambda r: r.frames),
    ):
        patch = 2
        counts = [
            text_of(r) + frames_of(r) * (r.grid[0] // patch) * (r.grid[1] // patch) for r in MIXED
        ]
        ends = list(itertools.accumulate(counts))
        for shards in (2, 4):
            size = -(-ends[-1] // shards)
            cuts = {size * i for i in range(1, shards)}
            assert not cuts & {0, *ends}, (family, shards)


def test_kinds_are_the_folder_dits() -> None:
    """Every layout runs on the two families the issue names; SD3 on two of them, Qwen-Image
    on every two-rank one."""
    assert [KINDS[f] for f in FAMILIES] == ["pixart_transformer", "flux_transformer"]
    assert set(SD3_TWO) <= set(TWO)
    assert LATER["qwen-image"] == tuple(TWO)


class TestNativeRefused:
    """A layout that splits the DiT refuses diffusers' class, which cannot honour it."""

    @pytest.mark.parametrize("family", FAMILIES)
    def test_native_under_a_split_is_refused(self, family: str, folders: dict[str, Path]) -> None:
        """loader = "native" under Ulysses is loader.native_parallel_layout; custom is admitted."""
        case = DitCase(
            family=family, folder=str(folders[family]), layout="sp_degree = 2\nulysses_degree = 2"
        )
        native = case.spec().replace("[parallel]", 'loader = "native"\n[parallel]')
        (refusal,) = admit_pipeline(decode_spec(native), Platform("cpu")).refusals()
        assert (refusal.code, refusal.component) == ("loader.native_parallel_layout", "transformer")
        assert "(sp_degree = 2, ulysses_degree = 2)" in refusal.message
        assert admit_pipeline(decode_spec(case.spec()), Platform("cpu")).refusals() == ()
