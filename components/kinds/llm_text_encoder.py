"""``llm_text_encoder``: a language model as a text encoder (Qwen2.5-VL, Qwen3).

Qwen-Image reads the last layer of ``Qwen2_5_VLForConditionalGeneration`` (its text path:
no image ever reaches it here), Z-Image the penultimate layer of a ``Qwen3Model``, and
Flux.2 klein three intermediate layers of a ``Qwen3ForCausalLM``, stacked. Each recipe
says which hidden states it reads (``read_layers``), and the model runs no layer past the
deepest of them: klein reads the input of layer 27, so Qwen3-4B runs 27 of its 36 layers,
and Z-Image's penultimate state is the last layer's input, so that layer never runs. Every
layer is still loaded: the folder's weights are declared and checked whole. The model
is called itself, so that the hooks of its residency and compilation run, but its
language-model head projects no token (logits over a vocabulary of 150,000 for every
token would be the largest product of the whole request, and no pipeline reads them).
The attention is causal: padding after a prompt never changes its tokens' states.
Templates and what is dropped of them are the recipes' (each pipeline's own).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

import torch
from torch import nn

from components.batch import Port, device_of
from components.folders.text import TextEncoderLoader, TextEncoderOptions, Tokens

__all__ = ["LlmTextEncoderLoader", "stop_after"]

# B texts, L tokens, E width

STACKS = {
    "Qwen2_5_VLForConditionalGeneration": "model.language_model.layers",
    "Qwen3Model": "layers",
    "Qwen3ForCausalLM": "model.layers",
}
"""Where each class keeps its decoder layers, which stream under layerwise offload."""
HEADED = ("Qwen2_5_VLForConditionalGeneration", "Qwen3ForCausalLM")
"""The classes with a language-model head, which takes the positions it projects
(``logits_to_keep``)."""


class LlmTextEncoderLoader(TextEncoderLoader):
    """Load a language model whose hidden states a pipeline takes as its text."""

    kind: ClassVar[str] = "llm_text_encoder"
    library = "transformers"
    classes = tuple(STACKS)
    block_stack = STACKS["Qwen3ForCausalLM"]
    """A placeholder: each class's own stack is ``STACKS``'s (see ``blocks``)."""

    def __init__(self, options: TextEncoderOptions) -> None:
        super().__init__(options)
        self._read: tuple[int, ...] = (-1,)  # the last state, until a recipe says

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

    def read_layers(self, layers: Sequence[int]) -> None:
        """Take ``layers`` as the hidden states every encode returns, as
        ``output_hidden_states`` counts them (0: the embeddings, -1: the last, after the final
        norm); a module built after this runs no layer past the deepest of them (``runs``)."""
        self._read = tuple(layers)

    @property
    def read(self) -> tuple[int, ...]:
        """The hidden states every encode returns, counted from the embeddings (0)."""
        return tuple(layer + self.layers + 1 if layer < 0 else layer for layer in self._read)

    @property
    def runs(self) -> int:
        """The layers an encode runs: hidden state k is layer k's input, made by layers 0 to
        k - 1; every layer (and the final norm) when the last state is read."""
        return min(max(self.read), self.layers)

    def build_native(self) -> nn.Module:
        """Build the class with every layer of the folder's weights, its decoder stopping after
        ``runs`` layers (``stop_after``)."""
        module = super().build_native()
        if self.runs < self.layers:
            stop_after(module, self._stack, self.runs)
        return module

    @property
    def _stack(self) -> str:
        return STACKS.get(self.class_name, "model.layers")

    def blocks(self, module: nn.Module) -> nn.ModuleList | None:
        """Return the decoder layers of this class (``STACKS``), in the order they run."""
        return self._block_list(module, self._stack)

    def block_count(self) -> int:
        """Return the decoder layers."""
        return self.layers

    def blocks_run(self) -> int:
        """Return the layers an encode runs (``runs``): layerwise offload fetches no other."""
        return self.runs

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
        self, module: nn.Module, tokens: Tokens, *, boolean_mask: bool
    ) -> list[torch.Tensor]:
        """Return the hidden states ``(B, L, E)`` that ``read_layers`` named, in its order.

        ``boolean_mask``: hand the model its attention mask as booleans (Z-Image does),
        else as the tokenizer's integers.
        """
        device = device_of(module)
        mask = tokens.mask.to(device)
        # the model itself, not its decoder submodule: a layerwise store's and compile's
        # hooks hang on it (called past them, a store never cleaned up after a forward)
        head = {"logits_to_keep": torch.empty(0, dtype=torch.long, device=device)}
        output = module(
            input_ids=tokens.ids.to(device),
            attention_mask=mask.bool() if boolean_mask else mask,
            output_hidden_states=True,
            use_cache=False,
            **(head if self.class_name in HEADED else {}),
        )
        return [output.hidden_states[layer] for layer in self.read]


def stop_after(module: nn.Module, stack: str, layers: int) -> None:
    """Make the decoder that holds ``stack`` (a path in ``module``) run its first ``layers``
    layers only.

    transformers' decoder runs its first ``num_hidden_layers`` layers and ties the last
    hidden state it returns to the final norm's output; stopped, that state is layer
    ``layers - 1``'s own output, as a run of every layer returns it.
    """
    config: Any = module.get_submodule(stack.rpartition(".")[0]).config
    config.num_hidden_layers = layers
    config.tie_last_hidden_states = False
