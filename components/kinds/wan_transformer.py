"""``wan_transformer``: diffusers' ``WanTransformer3DModel``, Wan's video DiT.

Patches of latent frames (1 x 2 x 2) attend to each other with 3D rotary positions
(frame, row, column), cross-attend to the UMT5 text (and, for Wan 2.1 image to video, to
the CLIP image states), and are modulated by the timestep: one per video, or one per
patch (Wan 2.2 TI2V, ``expand_timesteps``). Its ``blocks`` stream under layerwise
offload. The custom path (the default) is ``components.models.dit.wan``; ``loader =
"native"`` builds diffusers' class.
"""

from __future__ import annotations

from typing import ClassVar

from attention import AttentionRole
from components.batch import Port
from components.cache import CacheSettings
from components.kinds.dit_loader import DitLoader
from components.loader import LoaderPath
from components.models.dit.wan import WanTransformer, unsupported
from components.sites import AttentionSite

__all__ = ["WanTransformerLoader"]


class WanTransformerLoader(DitLoader):
    """Load ``WanTransformer3DModel``: the denoiser, strict about global backends."""

    kind: ClassVar[str] = "wan_transformer"
    classes = ("WanTransformer3DModel",)
    block_stack = "blocks"

    @property
    def patch(self) -> tuple[int, int, int]:
        """The patch (frames, rows, columns) each token covers."""
        frames, rows, columns = (int(side) for side in self.config["patch_size"])
        return frames, rows, columns

    @property
    def image_width(self) -> int | None:
        """The image encoder's state width it cross-attends to (Wan 2.1 I2V), or None."""
        width = self.config.get("image_dim")
        return None if width is None else int(width)

    @property
    def reads_image_pairs(self) -> bool:
        """Whether it reads the states of a first and a last image together (Wan 2.1 FLF2V:
        ``pos_embed_seq_len`` positions them), rather than of one image."""
        return self.config.get("pos_embed_seq_len") is not None

    def block_count(self) -> int:
        """Return the DiT's blocks (``num_layers``)."""
        return int(self.config["num_layers"])

    def sites(self) -> tuple[AttentionSite, ...]:
        """Declare ``self`` (video tokens, packed) and ``cross`` (to the request's text and
        image states)."""
        cross = AttentionSite(name="cross", role=AttentionRole.CROSS, heads=self.heads)
        return (self.self_site(), cross)

    def custom_problem(self) -> str | None:
        """Name what of the config the custom path does not build."""
        problem = unsupported(self.config)
        return None if problem is None else f"the custom Wan DiT does not build {problem}"

    def custom_module(self) -> WanTransformer:
        """Build the project's Wan DiT on the ``self`` and ``cross`` sites."""
        return WanTransformer(self.config, self.sites())

    def cache_problem(self, path: LoaderPath, settings: CacheSettings) -> str | None:
        """Refuse a step cache: neither path of the Wan DiT runs one yet."""
        return f"kind '{self.kind}' runs no step cache yet (on either path)"

    def reads(self) -> tuple[Port, ...]:
        """Read the text context ``text_dim`` wide (and image states ``image_dim`` wide),
        and latents of ``out_channels`` (image to video adds the condition's channels)."""
        ports = [
            Port(field="context", width=int(self.config["text_dim"])),
            Port(field="latents", width=self.latent_channels),
        ]
        if self.image_width is not None:
            ports.append(Port(field="image_context", width=self.image_width))
        return tuple(ports)

    def writes(self) -> tuple[Port, ...]:
        """Write latents of ``out_channels``."""
        return (Port(field="latents", width=self.latent_channels),)

    @property
    def latent_channels(self) -> int:
        """The latent channels it predicts (``out_channels``, else ``in_channels``)."""
        return int(self.config.get("out_channels") or self.config["in_channels"])
