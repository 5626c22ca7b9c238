"""``flux2_transformer``: diffusers' ``Flux2Transformer2DModel`` (Flux.2's DiT).

Like Flux's, two stacks run in turn: double-stream ``transformer_blocks``, then
single-stream ``single_transformer_blocks``; layerwise offload streams the first then the
second. It reads several hidden states of a language model stacked along the width
(``joint_attention_dim``), and the VAE's latents patchified two by two (``in_channels``
is four times their channels).
"""

from __future__ import annotations

from typing import ClassVar

from components.batch import Port
from components.folders.loader import FolderLoader

__all__ = ["Flux2TransformerLoader"]

PACKING = 4
"""Latent positions per token: 2 x 2 patches of the VAE's latents make one."""


class Flux2TransformerLoader(FolderLoader):
    """Load ``Flux2Transformer2DModel``: the denoiser, strict about global backends."""

    kind: ClassVar[str] = "flux2_transformer"
    library = "diffusers"
    classes = ("Flux2Transformer2DModel",)
    block_stack = ("transformer_blocks", "single_transformer_blocks")

    def block_count(self) -> int:
        """Return the blocks of both stacks (``num_layers + num_single_layers``)."""
        return int(self.config["num_layers"]) + int(self.config["num_single_layers"])

    def reads(self) -> tuple[Port, ...]:
        """Read the stacked hidden states and unpacked latents."""
        return (
            Port(field="context", width=int(self.config["joint_attention_dim"])),
            Port(field="latents", width=int(self.config["in_channels"]) // PACKING),
        )

    def writes(self) -> tuple[Port, ...]:
        """Write unpacked latents."""
        out = self.config.get("out_channels") or self.config["in_channels"]
        return (Port(field="latents", width=int(out) // PACKING),)
