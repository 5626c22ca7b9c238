"""Classifier-free guidance in the reference pipeline: the scale and negative prompts."""

from __future__ import annotations

import torch

from components.batch import Batch
from lifecycle.orchestrator import Orchestrator

STAGES = ("encode", "denoise", "decode")


def images(orch: Orchestrator, **guidance: object) -> torch.Tensor:
    """Run one seeded request with ``guidance`` fields on its batch; return its images."""
    batch = Batch(
        generator=torch.Generator().manual_seed(0), steps=2, prompts=["a red fox"], **guidance
    )
    with orch.request() as request:
        for stage in STAGES:
            request.run(stage, batch)
    assert batch.images is not None
    return batch.images


class TestGuidance:
    def test_negative_prompts_are_embedded_for_the_unconditional_branch(
        self, reference_orchestrator: Orchestrator
    ) -> None:
        """The text encoder embeds negative prompts, one (L, E) tensor each."""
        reference_orchestrator.load()
        batch = Batch(
            generator=torch.Generator().manual_seed(0),
            prompts=["a red fox"],
            negative_prompts=["blurry, dark"],
        )
        with reference_orchestrator.request() as request:
            request.run("encode", batch)
        assert batch.negative_context is not None
        assert batch.context is not None
        (negative,) = batch.negative_context
        assert negative.shape[1] == batch.context[0].shape[1]
        assert not torch.equal(negative, batch.context[0][: negative.shape[0]])

    def test_negative_prompt_steers_only_a_guided_request(
        self, reference_orchestrator: Orchestrator
    ) -> None:
        """A negative prompt changes a guided image and leaves an unguided one alone."""
        reference_orchestrator.load()
        plain = images(reference_orchestrator, guidance_scale=1.0)
        unguided_negative = images(
            reference_orchestrator, guidance_scale=1.0, negative_prompts=["blurry, dark"]
        )
        guided = images(reference_orchestrator, guidance_scale=4.0)
        guided_negative = images(
            reference_orchestrator, guidance_scale=4.0, negative_prompts=["blurry, dark"]
        )
        assert torch.equal(plain, unguided_negative)
        assert not torch.equal(plain, guided)
        assert not torch.equal(guided, guided_negative)
