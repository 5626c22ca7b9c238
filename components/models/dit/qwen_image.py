"""The project's Qwen-Image DiT: diffusers' ``QwenImageTransformer2DModel``, on ``Attention``.

Its blocks are Flux's double-stream blocks under other names (``img_mod``, ``txt_mod``,
``img_mlp``, ``txt_mlp``): text and image rows apart, attending jointly, text first. The
language model's states are RMS-normalised (``txt_norm``) before ``txt_in``. Padded text
tokens, which diffusers' call masks, are left out of the packed sequence: what the mask
does there. Rotary embeddings are Qwen's, per axis (frame, height, width) in float32 from
integer positions, the image's rows and columns centred on 0 (``scale_rope``) and the
text's positions starting past the image's larger half side.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import torch
from torch import nn

from components.models.dit.attention import DitAttention
from components.models.dit.base import TensorPlan, attention_dims
from components.models.dit.flux import (
    PROJECTIONS,
    DoubleBlock,
    JointInputs,
    JointTransformer,
)
from components.models.dit.layers import FeedForward, Modulation, TimestepEmbedding
from components.models.dit.layers import timestep_features as features
from components.sites import AttentionSite

__all__ = ["QwenImageInputs", "QwenImageTransformer", "unsupported"]

# B requests, E width, D head dim, h w token grid, L_i / N_i text / image tokens of request i

EPS = 1e-6
ROPE_THETA = 10_000
TIME_SCALE = 1000
"""Qwen's ``Timesteps(scale=1000)``: the timestep in [0, 1] scales the angles after the product."""
UNSUPPORTED = ("zero_cond_t", "use_additional_t_cond", "use_layer3d_rope", "guidance_embeds")
"""Configuration flags of the edit models' DiTs, which this module does not build."""


class QwenImageInputs(NamedTuple):
    """One group's arguments to ``QwenImageTransformer2DModel``, as diffusers' call passes them."""

    hidden_states: torch.Tensor  # (B, N, 4C) packed latents
    encoder_hidden_states: torch.Tensor  # (B, L, E) text, zero-padded to the longest
    encoder_hidden_states_mask: torch.Tensor | None  # (B, L), None when nothing is padded
    timestep: torch.Tensor  # (B,) in [0, 1]
    img_shapes: list[list[tuple[int, int, int]]]  # (frames, h, w) in tokens, per image


def axis_rotation(positions: torch.Tensor, width: int) -> torch.Tensor:
    """Return the rotation ``(len, width/2)`` (complex) of integer ``positions`` on one axis,
    as diffusers' ``QwenEmbedRope.rope_params`` computes its tables (float32)."""
    inverse = 1.0 / torch.pow(
        ROPE_THETA, torch.arange(0, width, 2, device=positions.device).to(torch.float32).div(width)
    )
    angles = torch.outer(positions, inverse)
    return torch.polar(torch.ones_like(angles), angles)


def request_rotation(
    text: torch.Tensor, grid: tuple[int, int], axes: Sequence[int]
) -> torch.Tensor:
    """Return one request's rotation ``(L + h * w, D/2)``: its text's (at positions ``text``,
    past the image's larger half side) then its image's, one frame of ``grid``."""
    h, w = grid
    device = text.device
    frame = axis_rotation(torch.zeros(1, dtype=torch.long, device=device), axes[0])
    rows = axis_rotation(torch.arange(-(h - h // 2), h // 2, device=device), axes[1])
    columns = axis_rotation(torch.arange(-(w - w // 2), w // 2, device=device), axes[2])
    image = torch.cat(
        [
            frame.expand(h * w, -1),
            rows[:, None].expand(h, w, -1).reshape(h * w, -1),
            columns[None].expand(h, w, -1).reshape(h * w, -1),
        ],
        dim=-1,
    )
    start = max(h // 2, w // 2)
    texts = torch.cat([axis_rotation(text + start, width) for width in axes], dim=-1)
    return torch.cat([texts, image])


class QwenImageBlock(DoubleBlock):
    """A Qwen-Image block: Flux's double-stream block, both streams clipped in float16."""

    def __init__(self, dim: int, heads: int, head_dim: int, site: AttentionSite) -> None:
        super().__init__()
        self.img_mod = nn.Sequential(nn.SiLU(), nn.Linear(dim, 6 * dim))
        self.attn = DitAttention(
            dim, heads, head_dim, site, context=True, context_out=True, qk_norm=True, eps=EPS
        )
        self.img_mlp = FeedForward(dim)
        self.txt_mod = nn.Sequential(nn.SiLU(), nn.Linear(dim, 6 * dim))
        self.txt_mlp = FeedForward(dim)

    clips_image = True

    def mlps(self) -> tuple[nn.Module, nn.Module]:
        """Return ``txt_mlp`` and ``img_mlp``."""
        return self.txt_mlp, self.img_mlp

    def modulations(
        self, condition: torch.Tensor
    ) -> tuple[Sequence[torch.Tensor], Sequence[torch.Tensor]]:
        """Return ``txt_mod``'s and ``img_mod``'s six vectors."""
        return self.txt_mod(condition).chunk(6, dim=1), self.img_mod(condition).chunk(6, dim=1)

    def tensor_plan(self) -> TensorPlan:
        """Split heads (q, k, v column-wise, outputs row-wise) and the MLPs' hidden units."""
        plan: TensorPlan = {f"attn.{name}": "colwise" for name in PROJECTIONS}
        plan |= {"attn.to_out.0": "rowwise", "attn.to_add_out": "rowwise"}
        for mlp in ("img_mlp", "txt_mlp"):
            plan |= {f"{mlp}.net.0.proj": "colwise", f"{mlp}.net.2": "rowwise"}
        return plan


class QwenTimeEmbedding(nn.Module):
    """The conditioning of every block: the timestep alone, ``(B, E)``."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.timestep_embedder = TimestepEmbedding(256, dim)

    def forward(self, timestep: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Embed ``(B,)`` timesteps in [0, 1], rounded to ``dtype`` first, as diffusers."""
        out: torch.Tensor = self.timestep_embedder(
            features(timestep.to(dtype), scale=TIME_SCALE).to(dtype)
        )
        return out


class QwenImageTransformer(JointTransformer):
    """Qwen-Image's DiT: the names, shapes and arithmetic of diffusers' class, requests packed.

    Args:
        config: the folder's ``config.json`` of ``QwenImageTransformer2DModel``.
        site: the declared ``self`` site (joint attention).
    """

    def __init__(self, config: Mapping[str, Any], site: AttentionSite) -> None:
        super().__init__()
        heads, head_dim, dim = attention_dims(config)
        patch = int(config.get("patch_size", 2))
        out_channels = int(config.get("out_channels") or config["in_channels"])
        joint = int(config["joint_attention_dim"])
        self.axes = tuple(int(a) for a in config["axes_dims_rope"])
        self.time_text_embed = QwenTimeEmbedding(dim)
        self.txt_norm = nn.RMSNorm(joint, eps=EPS)
        self.img_in = nn.Linear(int(config["in_channels"]), dim)
        self.txt_in = nn.Linear(joint, dim)
        self.transformer_blocks = nn.ModuleList(
            QwenImageBlock(dim, heads, head_dim, site) for _ in range(int(config["num_layers"]))
        )
        self.single_transformer_blocks = nn.ModuleList()  # Qwen-Image has none
        self.norm_out = Modulation(dim, 2)
        self.proj_out = nn.Linear(dim, patch * patch * out_channels)

    def joint_inputs(self, groups: Sequence[QwenImageInputs]) -> JointInputs:
        """Return each request's real text tokens, image rows, conditioning and rotation."""
        texts, images, rotations = [], [], []
        for group in groups:
            for row, (context, shapes) in enumerate(
                zip(group.encoder_hidden_states, group.img_shapes, strict=True)
            ):
                (frames, h, w), *_ = shapes
                if frames != 1 or len(shapes) != 1:
                    raise ValueError("the Qwen-Image DiT denoises one frame of one image")
                mask = group.encoder_hidden_states_mask
                real = (
                    torch.arange(len(context), device=context.device)
                    if mask is None
                    else mask[row].bool().nonzero().flatten()
                )
                texts.append(context[real])
                images.append(group.hidden_states[row])
                rotations.append(request_rotation(real, (h, w), self.axes))
        dtype = self.img_in.weight.dtype
        condition = self.time_text_embed(torch.cat([g.timestep for g in groups]), dtype)
        return JointInputs(texts, images, condition, torch.cat(rotations))

    def embed_text(self, text: torch.Tensor) -> torch.Tensor:
        """RMS-normalise the language model's states and project them (``txt_in``)."""
        out: torch.Tensor = self.txt_in(self.txt_norm(text))
        return out

    def embed_image(self, image: torch.Tensor) -> torch.Tensor:
        """Project packed latents to the model width (``img_in``)."""
        out: torch.Tensor = self.img_in(image)
        return out


def unsupported(config: Mapping[str, Any]) -> str | None:
    """Say which flag of ``config`` this module does not build (the edit models'), or None."""
    flags = [flag for flag in UNSUPPORTED if config.get(flag)]
    return f"{', '.join(flags)} (an edit model's DiT)" if flags else None
