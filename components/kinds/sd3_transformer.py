"""``sd3_transformer``: diffusers' ``SD3Transformer2DModel`` (the MMDiT of Stable Diffusion 3).

Text and image tokens attend jointly in its ``transformer_blocks``, which stream under
layerwise offload. It reads the text of both CLIP encoders and T5, joined along the
sequence, and the two CLIP pooled vectors side by side. The custom path (the default)
is ``components.models.dit.sd3``; ``loader = "native"`` builds diffusers' class.
"""

from __future__ import annotations

from typing import ClassVar

from components.batch import Port
from components.kinds.dit_loader import DitLoader
from components.models.dit.sd3 import RMS_NORM, Sd3Transformer

__all__ = ["Sd3TransformerLoader"]


class Sd3TransformerLoader(DitLoader):
    """Load ``SD3Transformer2DModel``: the denoiser, strict about global backends."""

    kind: ClassVar[str] = "sd3_transformer"
    classes = ("SD3Transformer2DModel",)
    block_stack = "transformer_blocks"

    def block_count(self) -> int:
        """Return the MMDiT's blocks (``num_layers``)."""
        return int(self.config["num_layers"])

    def custom_problem(self) -> str | None:
        """Say which SD3.5 options of ``config`` the custom path does not build."""
        config = self.config
        problems = []
        if config.get("dual_attention_layers"):
            problems.append("dual_attention_layers (SD3.5's second image attention)")
        if config.get("qk_norm") not in (None, RMS_NORM):
            problems.append(f"qk_norm = {config['qk_norm']!r}")
        if int(config.get("caption_projection_dim", 0)) != self.heads * int(
            config["attention_head_dim"]
        ):
            problems.append("a caption_projection_dim other than the width")
        if not problems:
            return None
        return f"its custom path builds SD3 blocks without {', '.join(problems)}"

    def custom_module(self) -> Sd3Transformer:
        """Build the project's SD3 MMDiT on the ``self`` site."""
        return Sd3Transformer(self.config, self.self_site())

    def reads(self) -> tuple[Port, ...]:
        """Read the joined text context, the joined pooled vectors and the latents."""
        return (
            Port(field="context", width=int(self.config["joint_attention_dim"])),
            Port(field="pooled", width=int(self.config["pooled_projection_dim"])),
            Port(field="latents", width=int(self.config["in_channels"])),
        )

    def writes(self) -> tuple[Port, ...]:
        """Write latents of ``out_channels``."""
        return (Port(field="latents", width=int(self.config["out_channels"])),)
