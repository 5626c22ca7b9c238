"""The project's SD3 MMDiT: diffusers' ``SD3Transformer2DModel`` on ``attention.Attention``.

Every block is double-stream: text and image rows keep their own weights and attend
jointly (the ``self`` site over each request's text + image tokens). The last block
only reads the text (``context_pre_only``): its text rows are neither projected out
nor updated.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any, NamedTuple

import torch
from torch import nn

from components.cache import StepCache, run_cached
from components.models.dit.attention import DitAttention
from components.models.dit.base import PackedTransformer, TensorPlan, attention_dims, regroup
from components.models.dit.layers import (
    FeedForward,
    Modulation,
    TextProjection,
    TimestepEmbedding,
    timestep_features,
)
from components.models.dit.layout import JointLayout, add_gated, modulate
from components.models.dit.patches import PatchEmbed, unpatchify
from components.models.dit.streams import Streams, owned
from components.sites import AttentionSite

__all__ = ["RMS_NORM", "Sd3Inputs", "Sd3Transformer"]

# B requests, C channels, E width, h w latent grid, T joint rows, L_i text tokens

EPS = 1e-6
RMS_NORM = "rms_norm"
"""The one ``qk_norm`` the custom path builds besides none (SD3.5)."""


class Sd3Inputs(NamedTuple):
    """One group of same-sized requests, as ``SD3Transformer2DModel.forward`` takes them."""

    hidden_states: torch.Tensor  # (B, C, h, w)
    encoder_hidden_states: torch.Tensor  # (B, L, joint_attention_dim)
    pooled_projections: torch.Tensor  # (B, P)
    timestep: torch.Tensor  # (B,)


class Sd3TimeTextEmbedding(nn.Module):
    """The conditioning of every block: timestep + pooled text, ``(B, E)``."""

    def __init__(self, dim: int, pooled: int) -> None:
        super().__init__()
        self.timestep_embedder = TimestepEmbedding(256, dim)
        self.text_embedder = TextProjection(pooled, dim, tanh_gelu=False)

    def forward(self, timestep: torch.Tensor, pooled: torch.Tensor) -> torch.Tensor:
        """Embed ``(B,)`` timesteps and ``(B, P)`` pooled vectors."""
        condition = self.timestep_embedder(timestep_features(timestep).to(pooled.dtype))
        out: torch.Tensor = condition + self.text_embedder(pooled)
        return out


class Sd3Block(nn.Module):
    """A joint block; the last one (``last``) only reads the text."""

    def __init__(
        self, dim: int, heads: int, head_dim: int, site: AttentionSite, *, last: bool, qk_norm: bool
    ) -> None:
        super().__init__()
        self.last = last
        self.norm1 = Modulation(dim, 6)
        self.norm1_context = Modulation(dim, 2 if last else 6)
        self.attn = DitAttention(
            dim, heads, head_dim, site, context=True, context_out=not last, qk_norm=qk_norm, eps=EPS
        )
        self.ff = FeedForward(dim)
        self.ff_context = None if last else FeedForward(dim)

    def forward(
        self, text: torch.Tensor, image: torch.Tensor, condition: torch.Tensor, layout: JointLayout
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Update text rows ``(n_t, E)`` and image rows ``(n_i, E)`` given ``(B, E)``."""
        shift, scale, gate, shift_mlp, scale_mlp, gate_mlp = self.norm1(condition)
        context = self.norm1_context(condition)
        image_rows, text_rows = layout.image.rows, layout.text.rows
        if self.last:
            c_scale, c_shift = context  # AdaLayerNormContinuous: scale first
        else:
            c_shift, c_scale, c_gate, c_shift_mlp, c_scale_mlp, c_gate_mlp = context
        qi, ki, vi = self.attn.project(modulate(image, image_rows, shift, scale, EPS))
        qt, kt, vt = self.attn.project_context(modulate(text, text_rows, c_shift, c_scale, EPS))
        q, k, v = layout.join(qt, qi), layout.join(kt, ki), layout.join(vt, vi)
        text_o, image_o = layout.split(self.attn.attend(q, k, v, layout))
        add_gated(image, self.attn.output(image_o), image_rows, gate)
        add_gated(
            image,
            self.ff(modulate(image, image_rows, shift_mlp, scale_mlp, EPS)),
            image_rows,
            gate_mlp,
        )
        if self.attn.to_add_out is None or self.ff_context is None:
            return text, image  # the last block: the text has been read
        add_gated(text, self.attn.to_add_out(text_o), text_rows, c_gate)
        h = modulate(text, text_rows, c_shift_mlp, c_scale_mlp, EPS)
        add_gated(text, self.ff_context(h), text_rows, c_gate_mlp)
        return text, image

    def tensor_plan(self) -> TensorPlan:
        """Split heads (q, k, v column-wise, outputs row-wise) and the MLPs' hidden units."""
        projections = ("to_q", "to_k", "to_v", "add_q_proj", "add_k_proj", "add_v_proj")
        plan: TensorPlan = {f"attn.{name}": "colwise" for name in projections}
        plan |= {"attn.to_out.0": "rowwise", "ff.net.0.proj": "colwise"}
        plan["ff.net.2"] = "rowwise"
        if not self.last:
            plan |= {
                "attn.to_add_out": "rowwise",
                "ff_context.net.0.proj": "colwise",
            }
            plan["ff_context.net.2"] = "rowwise"
        return plan


class Sd3Transformer(PackedTransformer):
    """SD3's MMDiT: the names, shapes and arithmetic of diffusers' class, requests packed.

    Args:
        config: the folder's ``config.json`` of ``SD3Transformer2DModel``.
        site: the declared ``self`` site (joint attention).
    """

    def __init__(self, config: Mapping[str, Any], site: AttentionSite) -> None:
        super().__init__()
        heads, head_dim, dim = attention_dims(config)
        self.patch = int(config["patch_size"])
        layers = int(config["num_layers"])
        out_channels = int(config.get("out_channels") or config["in_channels"])
        self.pos_embed = PatchEmbed(
            int(config["in_channels"]),
            dim,
            self.patch,
            int(config["pos_embed_max_size"]),
            stored=True,
        )
        self.time_text_embed = Sd3TimeTextEmbedding(dim, int(config["pooled_projection_dim"]))
        self.context_embedder = nn.Linear(
            int(config["joint_attention_dim"]), int(config["caption_projection_dim"])
        )
        qk_norm = config.get("qk_norm") == RMS_NORM
        self.transformer_blocks = nn.ModuleList(
            Sd3Block(dim, heads, head_dim, site, last=i == layers - 1, qk_norm=qk_norm)
            for i in range(layers)
        )
        self.norm_out = Modulation(dim, 2)
        self.proj_out = nn.Linear(dim, self.patch * self.patch * out_channels)

    def forward(
        self, groups: Sequence[Sd3Inputs], cache: StepCache | None = None
    ) -> list[torch.Tensor]:
        """Predict ``(B_g, C_out, h_g, w_g)`` for every group, all requests in one packed pass."""
        tokens = [self.pos_embed(g.hidden_states) for g in groups]  # (B_g, N_g, E) each
        images = [x for group in tokens for x in group]  # (N_i, E) each
        texts = [c for group in groups for c in group.encoder_hidden_states]  # (L_i, E_j)
        device = images[0].device
        text_counts, image_counts = [t.shape[0] for t in texts], [x.shape[0] for x in images]
        condition = self.time_text_embed(
            torch.cat([g.timestep for g in groups]),
            torch.cat([g.pooled_projections for g in groups]),
        )  # (B, E)
        if cache is None:
            layout = JointLayout(text_counts, image_counts, device, self.sequence)
            image = layout.image.take(torch.cat(images))  # (n_i, E)
            text = self.context_embedder(layout.text.take(torch.cat(texts)))  # (n_t, E)
            for block in self.transformer_blocks:
                text, image = block(text, image, condition, layout)
        else:
            streams = run_cached(
                self,
                Streams(
                    text=self.context_embedder(torch.cat(texts)),
                    image=torch.cat(images),
                    text_counts=tuple(text_counts),
                    image_counts=tuple(image_counts),
                    condition=condition,
                ),
                cache,
            )
            layout, image = JointLayout(text_counts, image_counts, device), streams.image
        scale, shift = self.norm_out(condition)
        out = self.proj_out(modulate(image, layout.image.rows, shift, scale, EPS))
        stacked = regroup(layout.gather_image(out), image_counts, [len(g.timestep) for g in groups])
        return [
            unpatchify(s, g.hidden_states.shape[-2:], self.patch)
            for s, g in zip(stacked, groups, strict=True)
        ]

    def depth(self) -> int:
        """Return the blocks of the stack."""
        return len(self.transformer_blocks)

    def run_blocks(self, state: Streams, start: int, stop: int) -> Streams:
        """Run blocks ``start`` to ``stop`` on every request of ``state``."""
        layout = JointLayout(
            state.text_counts, state.image_counts, state.image.device, self.sequence
        )
        text = owned(layout.text.take(state.text), state.text)
        image = owned(layout.image.take(state.image), state.image)
        for block in self.transformer_blocks[start:stop]:
            text, image = block(text, image, state.condition, layout)
        text, image = layout.gather_streams(text, image)
        return state._replace(text=text, image=image)

    def tensor_plans(self, shards: int) -> Iterator[tuple[nn.Module, TensorPlan]]:
        """Yield every block with its split."""
        for block in self.transformer_blocks:
            assert isinstance(block, Sd3Block)
            yield block, block.tensor_plan()
