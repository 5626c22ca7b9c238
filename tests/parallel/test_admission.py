"""Layout refusals come from admission or the world check, before any process group exists."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch.distributed as dist

from attention import Platform
from components import ParallelLayout, registry
from lifecycle import AdmissionRefused, ComponentState, Orchestrator, TransitionRefused
from lifecycle.admission import admit_pipeline
from lifecycle.admission.parallel_layout import asked_splits
from lifecycle.spec.reading import decode_spec
from tests.conftest import Lifecycle
from tests.lifecycle.kinds_for_tests import NativeOnlyKind

CPU = Platform("cpu")


@pytest.fixture(autouse=True)
def native_only_kind() -> Iterator[None]:
    """Register the test kind ``test_native_only`` (no FSDP declared) for each test."""
    registry.register_kind(NativeOnlyKind)
    yield
    registry.unregister_kind(NativeOnlyKind.kind)


def orchestrator(text: str) -> Orchestrator:
    """Build a CPU orchestrator of the spec ``text``."""
    return Orchestrator(decode_spec(text), platform=CPU)


class TestAdmission:
    """What admission refuses in a layout, from real specs."""

    def test_a_split_nothing_implements_is_refused(self) -> None:
        """Tensor parallel over a VAE-only pipeline is refused: no kind splits heads."""
        orch = orchestrator(
            'name = "p"\n[parallel]\ntp_size = 2\n[components.vae]\nkind = "tiny_vae"\n'
        )
        with pytest.raises(AdmissionRefused) as err:
            orch.admit()
        (refusal,) = err.value.refusals
        assert refusal.code == "parallel.invalid_layout"
        assert refusal.message.startswith(
            "[parallel] tp_size = 2 splits heads (tensor parallel), but no component of the "
            "pipeline has a kind that implements it (kinds: tiny_vae)"
        )
        assert orch.state("vae") is ComponentState.CONFIGURED
        assert not dist.is_initialized()

    def test_fsdp_of_a_kind_that_does_not_shard_is_refused(self) -> None:
        """FSDP naming a component whose kind does not declare it works sharded is refused."""
        orch = orchestrator(
            'name = "p"\n[parallel]\nsp_degree = 2\nulysses_degree = 2\nfsdp = ["g"]\n'
            '[components.dit]\nkind = "tiny_dit"\n[components.g]\nkind = "test_native_only"\n'
            'loader = "custom"\n'
        )
        with pytest.raises(AdmissionRefused) as err:
            orch.admit()
        codes = {(r.component, r.code) for r in err.value.refusals}
        assert ("g", "parallel.invalid_layout") in codes
        assert any("works sharded by FSDP" in r.message for r in err.value.refusals)

    def test_fsdp_with_tensor_parallel_on_one_component_is_refused(self) -> None:
        """FSDP over a component tensor parallel also splits (2-D) is refused: not built."""
        orch = orchestrator(
            'name = "p"\n[parallel]\ntp_size = 2\nfsdp = ["dit"]\n'
            '[components.dit]\nkind = "tiny_dit"\n'
        )
        with pytest.raises(AdmissionRefused) as err:
            orch.admit()
        (refusal,) = err.value.refusals
        assert "FSDP over tensor-parallel shards (2-D) is not built" in refusal.message

    @pytest.mark.parametrize("target", ["disk", "host"])
    def test_offloading_sharded_weights_is_refused_where_it_cannot_run(
        self, tmp_path: Path, target: str
    ) -> None:
        """An offloaded FSDP component is refused for disk (or CUDA); host on a CPU passes."""
        spec = decode_spec(
            'name = "p"\n[parallel]\ntp_size = 2\nfsdp = ["vae"]\n'
            f'[memory]\noffload_target = "{target}"\noffload_dir = "{tmp_path}"\n'
            '[components.dit]\nkind = "tiny_dit"\n[components.vae]\nkind = "tiny_vae"\n'
            'residency = "component_offload"\n[[stages]]\nname = "s"\nuses = ["dit", "vae"]\n'
        )
        refusals = admit_pipeline(spec, CPU).refusals()
        if target == "host":
            assert refusals == ()
            return
        (refusal,) = refusals
        assert (refusal.code, refusal.component) == ("residency.not_offloadable", "vae")
        assert "offloading DTensor shards to the disk target on cpu is not built" in (
            refusal.message
        )

    def test_an_implemented_split_is_admitted(self) -> None:
        """Ulysses x ring with FSDP over the DiT and the VAE is admitted on one process."""
        orch = orchestrator(
            'name = "p"\n[parallel]\nsp_degree = 4\nulysses_degree = 2\nring_degree = 2\n'
            'fsdp = ["dit", "vae"]\n[components.dit]\nkind = "tiny_dit"\n'
            '[components.vae]\nkind = "tiny_vae"\n'
        )
        orch.admit()
        assert orch.state("dit") is ComponentState.ADMITTED

    def test_world_size_is_checked_before_any_process_group(self) -> None:
        """Loading a 2-process layout in one process is refused and joins no process group."""
        orch = orchestrator(
            'name = "p"\n[parallel]\nsp_degree = 2\nulysses_degree = 2\n'
            '[components.dit]\nkind = "tiny_dit"\n'
        )
        with pytest.raises(TransitionRefused) as err:
            orch.load()
        assert err.value.codes == ("parallel.invalid_layout",)
        assert "needs 2 processes, but 1 was launched" in err.value.refusals[0].message
        assert orch.state("dit") is ComponentState.ADMITTED
        assert not dist.is_initialized()

    def test_check_refuses_from_a_real_spec(self, tmp_path: Path, lifecycle: Lifecycle) -> None:
        """``lifecycle check`` refuses a layout nothing implements with exit 1 and the fix."""
        spec = tmp_path / "split.toml"
        spec.write_text('name = "x"\n[parallel]\ntp_size = 2\n[components.a]\nkind = "tiny_vae"\n')
        result = lifecycle("check", spec)
        assert result.returncode == 1
        assert "parallel.invalid_layout" in result.stdout
        assert "fix: set tp_size = 1, or add a component whose kind implements" in result.stdout


class TestSplits:
    """The splits a layout asks for, as typed rows with each kind's own declaration."""

    def test_each_split_asked_is_one_row(self) -> None:
        """tp, sp and cfg each give one row naming the setting, its fix and what it splits."""
        layout = ParallelLayout(tp_size=2, sp_degree=2, ulysses_degree=2, cfg_parallel=True)
        assert [(s.setting, s.fix, s.what) for s in asked_splits(layout)] == [
            ("tp_size = 2", "tp_size = 1", "heads (tensor parallel)"),
            ("sp_degree = 2", "sp_degree = 1", "sequences"),
            ("cfg_parallel = true", "cfg_parallel = false", "guidance branches"),
        ]

    def test_rows_ask_each_kind_what_it_implements(self) -> None:
        """The DiT implements every split; the VAE none; data parallel asks for no split."""
        layout = ParallelLayout(tp_size=2, sp_degree=2, ulysses_degree=2, cfg_parallel=True)
        dit = registry.get("tiny_dit").from_options({})
        vae = registry.get("tiny_vae").from_options({})
        assert [(s.implemented_by(dit), s.implemented_by(vae)) for s in asked_splits(layout)] == [
            (True, False)
        ] * 3
        assert asked_splits(ParallelLayout(dp_size=2)) == []
