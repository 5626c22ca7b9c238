"""Classifier-free guidance in the reference pipeline: the scale and negative prompts."""

from __future__ import annotations

import torch

from components.batch import Batch
from lifecycle.orchestrator import Orchestrator
from tests.lifecycle.test_requests import generate

PROMPT = ["a red fox"]
NEGATIVE = ["blurry, dark"]


class TestGuidance:
    def test_negative_prompts_are_embedded_for_the_unconditional_branch(
        self, reference_orchestrator: Orchestrator
    ) -> None:
        """The text encoder embeds negative prompts, one (L, E) tensor each."""
        reference_orchestrator.load()
        batch = Batch(
            generator=torch.Generator().manual_seed(0), prompts=PROMPT, negative_prompts=NEGATIVE
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
        orch = reference_orchestrator
        orch.load()
        plain = generate(orch, prompts=PROMPT, guidance_scale=1.0)
        unguided_negative = generate(
            orch, prompts=PROMPT, guidance_scale=1.0, negative_prompts=NEGATIVE
        )
        guided = generate(orch, prompts=PROMPT, guidance_scale=4.0)
        guided_negative = generate(
            orch, prompts=PROMPT, guidance_scale=4.0, negative_prompts=NEGATIVE
        )
        assert torch.equal(plain, unguided_negative)
        assert not torch.equal(plain, guided)
        assert not torch.equal(guided, guided_negative)
