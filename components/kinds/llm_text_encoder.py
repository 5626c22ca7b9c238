"""``llm_text_encoder``: a language model as a text encoder (Qwen2.5-VL, Qwen3).

Qwen-Image reads the last layer of ``Qwen2_5_VLForConditionalGeneration`` (its text path:
no image ever reaches it here), Z-Image the penultimate layer of a ``Qwen3Model``, and
Flux.2 klein three intermediate layers of a ``Qwen3ForCausalLM``, stacked. Each asks
``hidden_states`` for the layers it takes; the model runs its decoder stack alone, never
its language-model head (logits over a vocabulary of 150,000 would be the largest
product of the whole request, and no pipeline reads them). The attention is causal:
padding after a prompt never changes its tokens' states. Templates and what is dropped
of them are the recipes' (each pipeline's own).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

import torch
from torch import nn

from components.batch import Port, device_of
from components.folders.text import TextEncoderLoader, Tokens

__all__ = ["LlmTextEncoderLoader"]

# B texts, L tokens, E width

STACKS = {
    "Qwen2_5_VLForConditionalGeneration": "model.language_model.layers",
    "Qwen3Model": "layers",
    "Qwen3ForCausalLM": "model.layers",
}
"""Where each class keeps its decoder layers, which stream under layerwise offload."""
DECODERS = {
    "Qwen2_5_VLForConditionalGeneration": "model",
    "Qwen3Model": "",
    "Qwen3ForCausalLM": "model",
}
"""The submodule of each class that runs the decoder stack without the head ("": itself)."""


class LlmTextEncoderLoader(TextEncoderLoader):
    """Load a language model whose hidden states a pipeline takes as its text."""

    kind: ClassVar[str] = "llm_text_encoder"
    library = "transformers"
    classes = tuple(STACKS)
    block_stack = STACKS["Qwen3ForCausalLM"]
    """A placeholder: each class's own stack is ``STACKS``'s (see ``blocks``)."""

    @property
    def text_config(self) -> dict[str, Any]:
        """The language model's part of ``config.json`` (Qwen2.5-VL nests it)."""
        nested = self.config.get("text_config")
        return {**self.config, **nested} if isinstance(nested, dict) else self.config

    @property
    def width(self) -> int:
        """E: the width of each layer's hidden states."""
        return int(self.text_config["hidden_size"])

    @property
    def layers(self) -> int:
        """The decoder layers (``num_hidden_layers``)."""
        return int(self.text_config["num_hidden_layers"])

    def blocks(self, module: nn.Module) -> nn.ModuleList | None:
        """Return the decoder layers of this class (``STACKS``), in the order they run."""
        return self._block_list(module, STACKS.get(self.class_name, "model.layers"))

    def block_count(self) -> int:
        """Return the decoder layers."""
        return self.layers

    def reads(self) -> tuple[Port, ...]:
        """Read the prompts."""
        return (Port(field="prompts"),)

    def writes(self) -> tuple[Port, ...]:
        """Write hidden states ``hidden_size`` wide (a recipe may stack several layers)."""
        return (Port(field="context", width=self.width),)

    def chat(self, text: str, **flags: object) -> str:
        """Return ``text`` as the user's message under the tokenizer's chat template, ready for
        the assistant's answer (``flags`` go to the template: ``enable_thinking``)."""
        with self._calls:
            templated: str = self.tokenizer.apply_chat_template(
                [{"role": "user", "content": text}],
                tokenize=False,
                add_generation_prompt=True,
                **flags,
            )
        return templated

    def hidden_states(
        self, module: nn.Module, tokens: Tokens, layers: Sequence[int], *, boolean_mask: bool
    ) -> list[torch.Tensor]:
        """Return the hidden states ``(B, L, E)`` after each of ``layers`` (0: the embeddings,
        -1: the last, after the final norm), as ``output_hidden_states`` counts them.

        ``boolean_mask``: hand the model its attention mask as booleans (Z-Image does),
        else as the tokenizer's integers.
        """
        device = device_of(module)
        mask = tokens.mask.to(device)
        decoder = module.get_submodule(DECODERS.get(self.class_name, ""))
        output = decoder(
            input_ids=tokens.ids.to(device),
            attention_mask=mask.bool() if boolean_mask else mask,
            output_hidden_states=True,
            use_cache=False,
        )
        return [output.hidden_states[layer] for layer in layers]
