"""Interfaces: admission walks the stages and refuses components that do not fit together."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from attention import Platform
from lifecycle.admission import admit_pipeline
from lifecycle.machines.tables import ComponentState
from lifecycle.orchestrator import Orchestrator
from lifecycle.refusals import AdmissionRefused, Refusal, RefusalCode
from lifecycle.spec.structs import PipelineSpec
from tests.lifecycle.conftest import ReferenceSpec


def with_stages(spec: PipelineSpec, *stages: tuple[str, ...]) -> PipelineSpec:
    """Return ``spec`` with one stage per tuple of uses, named s0, s1, ..."""
    raw: dict[str, Any] = msgspec.to_builtins(spec)
    raw["stages"] = [{"name": f"s{i}", "uses": list(uses)} for i, uses in enumerate(stages)]
    return msgspec.convert(raw, PipelineSpec)


def mismatches(spec: PipelineSpec, platform: Platform) -> list[Refusal]:
    """Return the interface refusals admission gives ``spec``."""
    return [
        r
        for r in admit_pipeline(spec, platform).refusals()
        if r.code is RefusalCode.INTERFACE_MISMATCH
    ]


class TestInterfaces:
    def test_reference_pipeline_fits(self, reference_spec: ReferenceSpec, cpu: Platform) -> None:
        """The reference pipeline's components fit together: no interface refusal."""
        assert mismatches(reference_spec(), cpu) == []

    def test_context_width_names_both_components_and_widths(
        self, reference_spec: ReferenceSpec, cpu: Platform
    ) -> None:
        """A DiT reading a 64-wide context after a 32-wide encoder is refused with both widths."""
        spec = reference_spec(
            text_encoder={"options": {"dim": 32}}, transformer={"options": {"context_dim": 64}}
        )
        (refusal,) = mismatches(spec, cpu)
        assert refusal.component == "transformer"
        assert refusal.message == (
            "component 'transformer' (stage 'denoise') reads context 64 wide, "
            "but 'text_encoder' writes it 32 wide"
        )
        assert refusal.hint == (
            "set components.transformer.options.context_dim = 32 or "
            "components.text_encoder.options.dim = 64"
        )

    @pytest.mark.parametrize(
        ("changes", "wide"),
        [
            ({"transformer": {"options": {"in_channels": 8}}}, "reads latents 4 wide"),
            ({"vae": {"options": {"latent_channels": 6}}}, "reads latents 6 wide"),
        ],
    )
    def test_latent_channels_must_agree(
        self,
        reference_spec: ReferenceSpec,
        cpu: Platform,
        changes: dict[str, dict[str, Any]],
        wide: str,
    ) -> None:
        """A DiT and a VAE that disagree on latent channels are refused at the VAE."""
        (refusal,) = mismatches(reference_spec(**changes), cpu)
        assert refusal.component == "vae"
        assert wide in refusal.message
        assert "'transformer' writes it" in refusal.message

    def test_a_reader_before_any_writer_makes_its_own_input(
        self, reference_spec: ReferenceSpec, cpu: Platform
    ) -> None:
        """Decoding before denoising reads nothing written yet, so any widths fit."""
        spec = reference_spec(vae={"options": {"latent_channels": 6}})
        assert (
            mismatches(with_stages(spec, ("vae",), ("text_encoder",), ("transformer",)), cpu) == []
        )

    def test_repeated_stages_refuse_once(
        self, reference_spec: ReferenceSpec, cpu: Platform
    ) -> None:
        """A mismatch met in several stages is one refusal."""
        spec = reference_spec(transformer={"options": {"context_dim": 64}})
        stages = (("text_encoder",), ("transformer",), ("text_encoder", "transformer"))
        assert len(mismatches(with_stages(spec, *stages), cpu)) == 1

    def test_refused_pipeline_leaves_every_component_configured(
        self, reference_spec: ReferenceSpec, cpu: Platform
    ) -> None:
        """A mismatch is refused by admit(), before anything is built."""
        orchestrator = Orchestrator(
            reference_spec(transformer={"options": {"in_channels": 8}}), platform=cpu
        )
        with pytest.raises(AdmissionRefused) as err:
            orchestrator.admit()
        assert err.value.codes == (RefusalCode.INTERFACE_MISMATCH,)
        assert {c.state for c in orchestrator.snapshot().components.values()} == {
            ComponentState.CONFIGURED
        }
