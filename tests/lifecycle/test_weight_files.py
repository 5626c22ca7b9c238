"""A weights file is held to its kind's declared tensors by admission, from its header."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file, save_model

from attention import Platform
from components import registry
from components.generic import GenericLoader
from components.weights import nonfinite
from lifecycle.admission import admit_pipeline
from lifecycle.admission.weight_files import weights_refusals
from lifecycle.machines.tables import ComponentState
from lifecycle.orchestrator import Orchestrator
from lifecycle.refusals import Refusal, RefusalCode, TransitionFailed
from lifecycle.spec.reading import decode_spec


def spec_text(weights: Path, options: str = "") -> str:
    """Return a one-stage spec of a tiny upsampler reading ``weights``."""
    return f"""
name = "w"
device = "cpu"
[components.up]
kind = "tiny_upsampler"
options = {{ weights = "{weights}" {options} }}
[[stages]]
name = "s"
uses = ["up"]
"""


def refusals(text: str, platform: Platform) -> tuple[Refusal, ...]:
    """Admit the spec ``text`` and return its refusals."""
    return admit_pipeline(decode_spec(text), platform).refusals()


@pytest.fixture
def good(tmp_path: Path) -> dict[str, torch.Tensor]:
    """The tensors of a seeded 16-channel upsampler (the kind's defaults)."""
    module = registry.get("tiny_upsampler").from_options({}).build("custom")
    return {n: t.clone() for n, t in module.state_dict().items()}


class TestWeightFiles:
    def test_matching_file_is_admitted_and_loads(
        self, tmp_path: Path, good: dict[str, torch.Tensor], cpu: Platform
    ) -> None:
        """A file written by the kind with the same options passes check and loads."""
        path = tmp_path / "up.safetensors"
        save_file(good, str(path))
        orchestrator = Orchestrator(decode_spec(spec_text(path)), platform=cpu)
        orchestrator.load()
        assert orchestrator.state("up").value == "resident"
        orchestrator.close()

    def test_other_options_are_refused_with_the_shapes(self, tmp_path: Path, cpu: Platform) -> None:
        """A file written with other options is refused at check, naming shapes both ways."""
        path = tmp_path / "up8.safetensors"
        save_model(
            registry.get("tiny_upsampler").from_options({"channels": 8}).build("custom"), str(path)
        )
        (refusal,) = refusals(spec_text(path), cpu)
        assert refusal.code is RefusalCode.WEIGHTS_MISMATCH
        assert "'conv_in.bias' has shape [8], the kind declares [16]" in refusal.message

    def test_missing_and_unexpected_tensors_are_named(
        self, tmp_path: Path, good: dict[str, torch.Tensor], cpu: Platform
    ) -> None:
        """A file lacking a tensor and holding a stray one is refused naming both."""
        del good["conv_mid.weight"]
        good["extra"] = torch.zeros(2)
        path = tmp_path / "partial.safetensors"
        save_file(good, str(path))
        (refusal,) = refusals(spec_text(path), cpu)
        assert "missing 'conv_mid.weight'" in refusal.message
        assert "unexpected 'extra'" in refusal.message

    @pytest.mark.parametrize("dtype", [torch.bool, torch.int8, torch.int64])
    def test_non_floating_weights_are_refused(
        self, tmp_path: Path, good: dict[str, torch.Tensor], cpu: Platform, dtype: torch.dtype
    ) -> None:
        """Bool and integer weights are refused from the header, never silently cast."""
        good["conv_in.bias"] = good["conv_in.bias"].to(dtype)
        path = tmp_path / "ints.safetensors"
        save_file(good, str(path))
        (refusal,) = refusals(spec_text(path), cpu)
        assert "'conv_in.bias' is stored as" in refusal.message
        assert "not a floating-point dtype" in refusal.message

    def test_half_precision_is_floating(
        self, tmp_path: Path, good: dict[str, torch.Tensor], cpu: Platform
    ) -> None:
        """Weights stored as bfloat16 are floating point: admitted."""
        path = tmp_path / "bf16.safetensors"
        save_file({n: t.to(torch.bfloat16) for n, t in good.items()}, str(path))
        assert refusals(spec_text(path), cpu) == ()

    @pytest.mark.parametrize(
        "raw",
        [
            b"",
            b"\x00" * 7,
            (2**60).to_bytes(8, "little") + b"{}",
            (200 * 2**20).to_bytes(8, "little") + b"{}",
            (2).to_bytes(8, "little") + b"[]",
            (12).to_bytes(8, "little") + b'{"t": 1}    ',
            (9).to_bytes(8, "little") + b"\xff\xfe{}{}{}{",
        ],
        ids=["empty", "short", "huge-length", "over-100MB", "list", "bad-entry", "not-utf8"],
    )
    def test_malformed_headers_are_refusals(
        self, tmp_path: Path, cpu: Platform, raw: bytes
    ) -> None:
        """A corrupt header is a weights_mismatch refusal that names the file, never a crash."""
        path = tmp_path / "bad.safetensors"
        path.write_bytes(raw)
        (refusal,) = refusals(spec_text(path), cpu)
        assert refusal.code is RefusalCode.WEIGHTS_MISMATCH
        assert "is not a valid safetensors file" in refusal.message

    def test_minilm_checkpoint_passes(self, cpu: Platform) -> None:
        """The shipped MiniLM checkpoint, with its integer position ids, fits its kind."""
        loader = registry.get("minilm_text_encoder").from_options({})
        if loader.options.weights is None:
            pytest.skip("the MiniLM weights package is not installed")
        text = """
name = "m"
device = "cpu"
[components.e]
kind = "minilm_text_encoder"
[[stages]]
name = "s"
uses = ["e"]
"""
        assert [r for r in refusals(text, cpu) if r.code is RefusalCode.WEIGHTS_MISMATCH] == []

    @pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
    def test_nonfinite_weights_fail_the_load(
        self, tmp_path: Path, good: dict[str, torch.Tensor], cpu: Platform, bad: float
    ) -> None:
        """A NaN or infinity in the data passes the header check and fails load, rolled back."""
        good["conv_mid.bias"][3] = bad
        path = tmp_path / "nan.safetensors"
        save_file(good, str(path))
        orchestrator = Orchestrator(decode_spec(spec_text(path)), platform=cpu)
        orchestrator.admit()
        with pytest.raises(TransitionFailed) as err:
            orchestrator.load()
        assert "'conv_mid.bias' hold NaN or infinity" in str(err.value)
        assert orchestrator.state("up") is ComponentState.ADMITTED

    def test_sum_overflow_is_not_mistaken_for_infinity(self) -> None:
        """Huge finite weights whose sum overflows float32 are still found finite."""
        huge = torch.full((4,), 3e38)
        assert not torch.isfinite(huge.sum())
        assert nonfinite({"w": huge}) == []
        assert nonfinite({"w": torch.tensor([3e38, float("nan")])}) == ["w"]

    def test_factory_kind_files_must_be_floating(self, tmp_path: Path) -> None:
        """A kind that declares no tensors still has integer weights refused from the header."""
        kind = GenericLoader.for_factory("test_linear", lambda: torch.nn.Linear(2, 2))
        path = tmp_path / "linear.safetensors"
        save_file({"weight": torch.zeros(2, 2, dtype=torch.int32), "bias": torch.zeros(2)}, path)
        (refusal,) = weights_refusals("c", kind.from_options({"weights": str(path)}))
        assert refusal.code is RefusalCode.WEIGHTS_MISMATCH
        assert "'weight' is stored as I32" in refusal.message
        assert "bias" not in refusal.message
