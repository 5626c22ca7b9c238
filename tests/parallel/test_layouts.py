"""Every parallel layout's output equals one process's, on real gloo process groups."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import msgspec
import pytest
import torch

from components.layout import ParallelLayout
from lifecycle.spec.reading import decode_spec
from tests.components.smooth_dit import write_smoothed_dit
from tests.parallel.layout_worker import (
    Case,
    CaseRunner,
    Outputs,
    Ran,
    Sent,
    run_alone,
    run_case,
    run_cases,
)
from tests.ranks import run_ranks

pytestmark = pytest.mark.long

# Float32, max|split - alone| / max|alone| over every output. Measured: 0 for Ulysses and
# K/V gather (the same kernels on the same rows), about 2e-7 for ring (LSE merge) and
# 3e-7 for tensor parallel (row-wise partial sums all-reduced); 1e-5 leaves room.
TOLERANCE = 1e-5
DEADLINE_S = {2: 240.0, 4: 360.0}
ROOT = Path(__file__).resolve().parents[2]
TENSOR_PARALLEL = ROOT / "examples" / "parallel" / "tiny_t2i_tensor_parallel.toml"

DIT = """
name = "dit"
device = "cpu"
[components.transformer]
kind = "tiny_dit"
options = {{ seed = 7, packed_sequences = {packed} }}
[parallel]
timeout_s = 30
"""

PIPELINE = """
name = "t2i"
device = "cpu"
[components.text_encoder]
kind = "tiny_text_encoder"
options = { seed = 1 }
[components.transformer]
kind = "tiny_dit"
options = { seed = 7 }
[components.vae]
kind = "tiny_vae"
options = { seed = 2 }
[components.upsampler]
kind = "tiny_upsampler"
options = { seed = 3 }
[parallel]
timeout_s = 30
sp_degree = 2
ulysses_degree = 2
fsdp = ["text_encoder", "transformer", "vae", "upsampler"]
"""


STAGE = '[[stages]]\nname = "denoise"\nuses = ["transformer"]\n'


def dit(layout: str, *, packed: bool = True) -> str:
    """Return a one-DiT spec with ``layout`` lines added to its ``[parallel]`` table."""
    return DIT.format(packed=str(packed).lower()) + layout + "\n"


TWO = {
    "ulysses": Case(spec=dit("sp_degree = 2\nulysses_degree = 2")),
    "ring": Case(spec=dit("sp_degree = 2\nring_degree = 2")),
    "kv_gather": Case(spec=dit("sp_degree = 2\nkv_gather_degree = 2")),
    "ring_dense": Case(spec=dit("sp_degree = 2\nring_degree = 2", packed=False)),
    "ulysses_dense": Case(spec=dit("sp_degree = 2\nulysses_degree = 2", packed=False)),
    "data_parallel": Case(spec=dit("dp_size = 2")),
    "tensor_parallel": Case(spec=dit("tp_size = 2"), direct=True),
    "cfg_parallel": Case(spec=dit("cfg_parallel = true") + STAGE, guidance=4.0),
    # TP over the DiT and FSDP over the VAE, through the lifecycle: load, requests, moves
    "lifecycle_tp_fsdp": Case(spec=TENSOR_PARALLEL.read_text(), component="vae", requests=2),
    **{
        f"fsdp_{name}": Case(spec=PIPELINE, component=name, direct=True)
        for name in ("text_encoder", "transformer", "vae", "upsampler")
    },
}
CACHED = {
    "ulysses_cache": ("sp_degree = 2\nulysses_degree = 2", 1.0),
    "ring_cache": ("sp_degree = 2\nring_degree = 2", 4.0),
    "kv_gather_cache": ("sp_degree = 2\nkv_gather_degree = 2", 1.0),
    "tensor_parallel_cache": ("tp_size = 2", 4.0),
    "data_parallel_cache": ("dp_size = 2", 4.0),
    "cfg_parallel_cache": ("cfg_parallel = true", 4.0),
}
"""Layouts run with a first-block cache on the smoothed tiny DiT: layout, guidance scale."""
CACHED_DIT = """
name = "dit"
device = "cpu"
[components.transformer]
kind = "tiny_dit"
options = {{ weights = "{weights}" }}
[components.transformer.cache]
method = "first_block"
threshold = 0.1
[parallel]
timeout_s = 30
{layout}
"""


def cached_cases(weights: Path) -> dict[str, Case]:
    """Return the ``CACHED`` cases: 16 guided or unguided steps of three requests, the DiT's
    weights from ``weights`` (``tests.components.smooth_dit``)."""
    return {
        name: Case(
            spec=CACHED_DIT.format(weights=weights, layout=layout) + STAGE,
            guidance=guidance,
            steps=16,
        )
        for name, (layout, guidance) in CACHED.items()
    }


FOUR = {
    "ulysses_x_ring": Case(spec=dit("sp_degree = 4\nulysses_degree = 2\nring_degree = 2")),
    "tp_x_ulysses": Case(spec=dit("tp_size = 2\nsp_degree = 2\nulysses_degree = 2"), direct=True),
}
# What each rank sends, by collective: proof that the layout really split the work.
SENT = {
    "ulysses": {"all_to_all", "output_gather"},
    "ring": {"ring", "output_gather"},
    "kv_gather": {"all_gather", "output_gather"},
    "ring_dense": {"ring", "output_gather"},
    "ulysses_dense": {"all_to_all", "output_gather"},
    "data_parallel": set(),
    "tensor_parallel": set(),  # DTensor's all-reduce, not attention traffic
    "cfg_parallel": {"guidance"},
    "fsdp_transformer": {"all_to_all", "output_gather"},
    "ulysses_x_ring": {"all_to_all", "ring", "output_gather"},
    "tp_x_ulysses": {"all_to_all", "output_gather"},
}


def spawn(
    world: int,
    cases: Mapping[str, Any],
    out_dir: Path,
    runner: CaseRunner = run_case,
    preload: Sequence[str] = (),
) -> None:
    """Run ``cases`` with ``runner`` on ``world`` ranks (their launcher imports ``preload``
    once); fail with every rank's error if one fails."""
    exits = run_ranks(
        run_cases,
        world,
        out_dir,
        cases,
        str(out_dir),
        runner,
        deadline_s=DEADLINE_S[world],
        preload=preload,
    )
    errors = "\n".join(path.read_text() for path in sorted(out_dir.glob("*.error")))
    assert exits == [0] * world, f"rank exit codes {exits}\n{errors}"


@pytest.fixture(scope="module")
def smooth_weights(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny DiT's weights with a timestep MLP that changes slowly over steps."""
    return write_smoothed_dit(tmp_path_factory.mktemp("smooth") / "dit.safetensors")


@pytest.fixture(scope="module")
def two(tmp_path_factory: pytest.TempPathFactory, smooth_weights: Path) -> Path:
    """The outputs of every two-rank case (the cached ones too), from one spawn of two gloo
    processes."""
    out_dir = tmp_path_factory.mktemp("two")
    spawn(2, TWO | cached_cases(smooth_weights), out_dir)
    return out_dir


@pytest.fixture(scope="module")
def four(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The outputs of every four-rank case, from one spawn of four gloo processes."""
    out_dir = tmp_path_factory.mktemp("four")
    spawn(4, FOUR, out_dir)
    return out_dir


Alone = Callable[[Case], Ran]
"""Runs a case in this one process (see the ``alone`` fixture)."""


@pytest.fixture(scope="module")
def alone() -> Alone:
    """Run a case in this one process, once per spec without its layout: most layouts of the
    tiny DiT compare with the same outputs."""
    ran: dict[bytes, Ran] = {}

    def run(case: Case) -> Ran:
        spec = msgspec.structs.replace(decode_spec(case.spec), parallel=ParallelLayout())
        key = msgspec.json.encode([spec, case.component, case.guidance, case.steps, case.requests])
        if key not in ran:
            ran[key] = run_alone(case)
        return ran[key]

    return run


def assert_equal_to_alone(out_dir: Path, name: str, case: Case, world: int, alone: Alone) -> None:
    """Assert rank 0's outputs of ``name`` equal one process's, and what each rank sent."""
    split: Outputs = torch.load(out_dir / f"{name}.pt")
    ran = alone(case)
    alone_outputs, alone_bytes = ran.outputs, ran.held_bytes
    assert len(split) == len(alone_outputs)
    for got, want in zip(split, alone_outputs, strict=True):
        assert got.shape == want.shape
        error = ((got - want).abs().max() / want.abs().max()).item()
        assert error < TOLERANCE, f"{name}: relative error {error}"
    for rank in range(world):
        path = out_dir / f"{name}.rank{rank}.json"
        did = msgspec.json.decode(path.read_bytes(), type=Sent)
        if name in SENT:
            assert set(did.sent) == SENT[name], f"{name} rank {rank} sent {did.sent}"
            assert all(count > 0 for count in did.sent.values())
        if name.startswith(("fsdp_", "tensor_parallel", "tp_")):
            # each rank keeps about half: FSDP shards every weight, TP the attention and MLP
            assert did.held_bytes < 0.75 * alone_bytes, f"{name} rank {rank} holds {did}"


class TestTwoRanks:
    """Layouts of two processes against one process on the same seed and weights."""

    @pytest.mark.parametrize("name", list(TWO))
    def test_layout_equals_one_process(self, two: Path, name: str, alone: Alone) -> None:
        """The layout's output equals the one-process output within the float32 tolerance."""
        assert_equal_to_alone(two, name, TWO[name], 2, alone)

    def test_lifecycle_moves_this_ranks_shards(self, two: Path, alone: Alone) -> None:
        """TP over the DiT and FSDP over the VAE load, run and move this rank's shards only."""
        moved_alone = alone(TWO["lifecycle_tp_fsdp"]).moved
        assert all(moved_alone.values())
        for rank in range(2):
            path = two / f"lifecycle_tp_fsdp.rank{rank}.json"
            moved = msgspec.json.decode(path.read_bytes(), type=Sent).moved
            # as many moves as in one process: the DiT stays resident, the others offload
            assert {c: len(m) for c, m in moved.items()} == {
                c: len(m) for c, m in moved_alone.items()
            }
            assert moved["text_encoder"] == moved_alone["text_encoder"]  # replicated
            for shard, whole in zip(moved["vae"], moved_alone["vae"], strict=True):
                assert 0.45 * whole < shard < 0.55 * whole  # FSDP: half of every weight
            (shard,), (whole,) = moved["transformer"], moved_alone["transformer"]
            assert shard < 0.75 * whole  # TP: half of the attention and MLP weights

    def test_a_layout_loaded_again_makes_no_process_groups(self, two: Path) -> None:
        """A load whose layout an earlier load of the rank had reuses that load's process
        groups (ring_dense: ring's; ulysses_dense: ulysses'); a new layout makes its own."""
        for rank in range(2):
            groups = {
                name: msgspec.json.decode(
                    (two / f"{name}.rank{rank}.json").read_bytes(), type=Sent
                ).groups
                for name in ("ring", "kv_gather", "ring_dense", "ulysses_dense")
            }
            assert groups["ring"] < groups["kv_gather"], groups
            assert groups["kv_gather"] == groups["ring_dense"] == groups["ulysses_dense"], groups


@pytest.mark.usefixtures("one_thread")
class TestCachedLayouts:
    """A step cache under every two-rank layout of the tiny DiT: one decision on every rank."""

    @pytest.mark.parametrize("name", list(CACHED))
    def test_ranks_skip_alike_and_equal_one_process(
        self, two: Path, name: str, smooth_weights: Path, alone: Alone
    ) -> None:
        """Both ranks skip the same steps of each row (the measured change summed across
        the cfg group, or gathered whole under sequence parallel), the same as one process,
        and the latents equal one process's within the float32 tolerance."""
        case = cached_cases(smooth_weights)[name]
        assert_equal_to_alone(two, name, case, 2, alone)
        patterns = alone(case).patterns
        assert len(patterns) == 3
        assert any("S" in pattern for pattern in patterns), patterns
        for rank in range(2):
            did = msgspec.json.decode((two / f"{name}.rank{rank}.json").read_bytes(), type=Sent)
            assert tuple(did.patterns) == patterns, f"{name} rank {rank}"


class TestFourRanks:
    """Layouts of four processes (two split dims) against one process."""

    @pytest.mark.parametrize("name", list(FOUR))
    def test_layout_equals_one_process(self, four: Path, name: str, alone: Alone) -> None:
        """The layout's output equals the one-process output within the float32 tolerance."""
        assert_equal_to_alone(four, name, FOUR[name], 4, alone)
