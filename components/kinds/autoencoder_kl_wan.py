"""``autoencoder_kl_wan``: diffusers' ``AutoencoderKLWan``, the causal video VAE of Wan.

Its convolutions are causal in time: diffusers decodes one latent frame at a time (four
video frames, the first one), each chunk reading the last frames of the one before from
a cache, and encodes the first frame then four at a time. This drives the library's own
decoder and encoder the same way, chunk after chunk, with a cache of its own per call (the
library keeps one on the module, which two requests decoding at once would share), and
writes each decoded chunk into the video as it comes: beyond the video itself a decode
holds one chunk's activations, where diffusers' joins the chunks as it goes and clamps the
whole video into a copy (about twice the video). An image-to-video condition is encoded
from its first frame and the zeros after it (and a last frame) made one chunk at a time,
never the whole clip.

Every chunk runs the whole decoder, so the weights have no blocks to stream in turn:
``layerwise_offload`` is refused (``residency.not_offloadable``); component offload works.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator
from functools import cached_property
from typing import Any, ClassVar

import torch
from torch import nn

from components.batch import RGB, Port
from components.folders.vae import VaeLoader

__all__ = ["AutoencoderKlWanLoader"]

# B videos, Z latent channels, f latent frames, h w latent grid, F frames, H W frame size


class AutoencoderKlWanLoader(VaeLoader):
    """Load ``AutoencoderKLWan`` (native path)."""

    kind: ClassVar[str] = "autoencoder_kl_wan"
    classes = ("AutoencoderKLWan",)
    unstreamable = (
        "each temporal chunk of a decode runs every layer of the decoder, so streaming its "
        "weights would move all of them once per chunk (a 81-frame video: 21 times)"
    )

    @property
    def scale_factor(self) -> int:
        """Frame pixels per latent position along each side (8; 16 for Wan 2.2's TI2V VAE)."""
        return int(self.config.get("scale_factor_spatial") or 8)

    @property
    def temporal_factor(self) -> int:
        """Video frames per latent frame after the first (4)."""
        return int(self.config.get("scale_factor_temporal") or 4)

    @property
    def latent_channels(self) -> int:
        """Z: the latent channels (``z_dim``)."""
        return int(self.config["z_dim"])

    @cached_property
    def normalisation(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The latents' per-channel mean and standard deviation ``(1, Z, 1, 1, 1)`` each."""
        shape = (1, self.latent_channels, 1, 1, 1)
        mean = torch.tensor(self.config["latents_mean"]).view(shape)
        std = torch.tensor(self.config["latents_std"]).view(shape)
        return mean, std

    def writes(self) -> tuple[Port, ...]:
        """Write RGB videos."""
        return (Port(field="videos", width=RGB),)

    def frames(self, latent_frames: int) -> int:
        """Return the video frames ``latent_frames`` decode into: ``1 + 4 (f - 1)``."""
        return 1 + self.temporal_factor * (latent_frames - 1)

    def decode(self, module: nn.Module, latents: torch.Tensor) -> torch.Tensor:
        """Decode latents ``(B, Z, f, h, w)`` (unnormalised) into a video ``(B, 3, F, H, W)``
        in [-1, 1], one latent frame at a time.

        Equals ``AutoencoderKLWan.decode(latents)`` (untiled): the same decoder calls on the
        same chunks, in the same order, with the same cache.
        """
        native: Any = module
        unpatchify = _library().unpatchify
        patch = self.config.get("patch_size")
        x = native.post_quant_conv(latents)
        cache = _cache(native.decoder)
        video: torch.Tensor | None = None
        at = 0
        for i in range(x.shape[2]):
            chunk = native.decoder(
                x[:, :, i : i + 1], feat_cache=cache, feat_idx=[0], first_chunk=i == 0
            )
            if patch is not None:
                chunk = unpatchify(chunk, patch_size=patch)
            if video is None:
                b, c, _, height, width = chunk.shape
                video = chunk.new_empty((b, c, self.frames(x.shape[2]), height, width))
            count = chunk.shape[2]
            torch.clamp(chunk, -1.0, 1.0, out=video[:, :, at : at + count])
            at += count
            del chunk  # the next chunk's activations take its place
        assert video is not None  # a latent has at least one frame
        assert at == video.shape[2]  # 1 + 4 (f - 1) frames, as declared
        return video

    def encode(self, module: nn.Module, chunks: Iterator[torch.Tensor]) -> torch.Tensor:
        """Encode a video given chunk by chunk (its first frame, then four frames at a time,
        each ``(B, 3, F_i, H, W)`` in [-1, 1]) into the mode of its latents ``(B, Z, f, h, w)``.

        Equals ``AutoencoderKLWan.encode(video).latent_dist.mode()`` on the video the chunks
        make up: the same encoder calls on the same chunks with the same cache.
        """
        native: Any = module
        patchify = _library().patchify
        patch = self.config.get("patch_size")
        cache = _cache(native.encoder)
        encoded = []
        for chunk in chunks:
            if patch is not None:
                chunk = patchify(chunk, patch_size=patch)
            encoded.append(native.encoder(chunk, feat_cache=cache, feat_idx=[0]))
        moments: torch.Tensor = native.quant_conv(torch.cat(encoded, dim=2))
        return moments[:, : self.latent_channels]  # the mean: the mode of the diagonal Gaussian


def _library() -> Any:
    """Return diffusers' module of the Wan VAE (its patching and its causal convolution)."""
    return importlib.import_module("diffusers.models.autoencoders.autoencoder_kl_wan")


def _cache(coder: nn.Module) -> list[Any]:
    """Return an empty causal cache for ``coder``: one slot per causal convolution."""
    causal = _library().WanCausalConv3d
    return [None] * sum(isinstance(m, causal) for m in coder.modules())
