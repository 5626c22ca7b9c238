"""The project's PixArt DiT: diffusers' ``PixArtTransformer2DModel`` on ``attention.Attention``.

Each block modulates by the timestep (adaLN-single: one table per block plus the
shared timestep projection), attends the image tokens of each request to each other
(site ``self``, packed) and to the request's own text (site ``cross``), then runs an
MLP. Masked text tokens are dropped before attention: diffusers adds -10000 to their
scores, which leaves them no weight at all.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any, NamedTuple

import torch
from torch import nn
from torch.nn.functional import silu

from components.cache import StepCache, run_cached
from components.models.dit.attention import DitAttention
from components.models.dit.base import PackedTransformer, TensorPlan, attention_dims, regroup
from components.models.dit.layers import (
    FeedForward,
    TextProjection,
    TimestepEmbedding,
    timestep_features,
)
from components.models.dit.layout import JointLayout, add_gated, modulate
from components.models.dit.patches import PatchEmbed, unpatchify
from components.models.dit.streams import Streams, owned
from components.sites import AttentionSite

__all__ = ["PixArtInputs", "PixArtTransformer"]

# B requests, C channels, E width, h w latent grid, n image rows, L_i text tokens

EPS = 1e-6
"""The epsilon of the final norm (the blocks take ``norm_eps`` from the config)."""
MICRO_CONDITIONED_SIZE = 128
"""The sample size of the one PixArt (alpha, 1024 px) conditioned on resolution and ratio."""


class PixArtInputs(NamedTuple):
    """One group of same-sized requests, as ``PixArtTransformer2DModel.forward`` takes them."""

    hidden_states: torch.Tensor  # (B, C, h, w)
    encoder_hidden_states: torch.Tensor  # (B, L, caption_channels)
    timestep: torch.Tensor  # (B,)
    encoder_attention_mask: torch.Tensor | None = None  # (B, L), 1 = a real token
    added_cond_kwargs: Mapping[str, torch.Tensor | None] | None = None  # resolution, ratio


class PixArtTimestepEmbedding(nn.Module):
    """The timestep embedding, with resolution and aspect ratio for the micro-conditioned DiT."""

    def __init__(self, dim: int, *, micro: bool) -> None:
        super().__init__()
        self.timestep_embedder = TimestepEmbedding(256, dim)
        self.resolution_embedder = TimestepEmbedding(256, dim // 3) if micro else None
        self.aspect_ratio_embedder = TimestepEmbedding(256, dim // 3) if micro else None

    def forward(
        self, timestep: torch.Tensor, conditions: Sequence[torch.Tensor] | None, dtype: torch.dtype
    ) -> torch.Tensor:
        """Embed ``(B,)`` timesteps (and ``(B, 2)`` resolutions, ``(B, 1)`` ratios): ``(B, E)``."""
        embedded: torch.Tensor = self.timestep_embedder(timestep_features(timestep).to(dtype))
        if self.resolution_embedder is None or self.aspect_ratio_embedder is None:
            return embedded
        if conditions is None:
            raise ValueError(
                "this PixArt DiT is conditioned on resolution and aspect ratio: pass "
                "added_cond_kwargs"
            )
        resolution, ratio = conditions
        count = timestep.shape[0]
        sizes = self.resolution_embedder(timestep_features(resolution.flatten()).to(dtype))
        ratios = self.aspect_ratio_embedder(timestep_features(ratio.flatten()).to(dtype))
        return embedded + torch.cat([sizes.reshape(count, -1), ratios.reshape(count, -1)], dim=1)


class AdaLayerNormSingle(nn.Module):
    """diffusers' ``AdaLayerNormSingle``: ``emb`` then ``linear``, shared by every block."""

    def __init__(self, dim: int, *, micro: bool) -> None:
        super().__init__()
        self.emb = PixArtTimestepEmbedding(dim, micro=micro)
        self.linear = nn.Linear(dim, 6 * dim)

    def forward(
        self, timestep: torch.Tensor, conditions: Sequence[torch.Tensor] | None, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Return the blocks' modulation ``(B, 6E)`` and the embedded timestep ``(B, E)``."""
        embedded = self.emb(timestep, conditions, dtype)
        return self.linear(silu(embedded)), embedded


class PixArtBlock(nn.Module):
    """One block: modulated self-attention, cross-attention to the text, modulated MLP."""

    def __init__(
        self,
        dim: int,
        heads: int,
        head_dim: int,
        text_dim: int,
        sites: tuple[AttentionSite, ...],
        eps: float,
    ) -> None:
        super().__init__()
        self_site, cross_site = sites
        self.eps = eps
        self.scale_shift_table = nn.Parameter(torch.zeros(6, dim))
        self.attn1 = DitAttention(dim, heads, head_dim, self_site)
        self.attn2 = DitAttention(dim, heads, head_dim, cross_site, kdim=text_dim)
        self.ff = FeedForward(dim)

    def forward(
        self,
        x: torch.Tensor,
        modulation: torch.Tensor,
        text: Sequence[torch.Tensor],
        layout: JointLayout,
    ) -> torch.Tensor:
        """Update image rows ``(n, E)`` given ``(B, 6E)`` and each request's text ``(L_i, E)``."""
        table = self.scale_shift_table[None] + modulation.reshape(modulation.shape[0], 6, -1)
        shift, scale, gate, shift_mlp, scale_mlp, gate_mlp = table.unbind(1)  # (B, E) each
        rows = layout.joint_rows
        q, k, v = self.attn1.project(modulate(x, rows, shift, scale, self.eps))
        add_gated(x, self.attn1.output(self.attn1.attend(q, k, v, layout)), rows, gate)
        x = x + self.attn2.cross(x, rows, text)
        add_gated(x, self.ff(modulate(x, rows, shift_mlp, scale_mlp, self.eps)), rows, gate_mlp)
        return x

    def tensor_plan(self) -> TensorPlan:
        """Split heads (q, k, v column-wise, outputs row-wise) and the MLP's hidden units."""
        plan: TensorPlan = {}
        for attn in ("attn1", "attn2"):
            plan |= {f"{attn}.to_{p}": "colwise" for p in "qkv"}
            plan[f"{attn}.to_out.0"] = "rowwise"
        return plan | {"ff.net.0.proj": "colwise", "ff.net.2": "rowwise"}


class PixArtTransformer(PackedTransformer):
    """PixArt's DiT: the names, shapes and arithmetic of diffusers' class, requests packed.

    Args:
        config: the folder's ``config.json`` of ``PixArtTransformer2DModel``.
        sites: the declared ``self`` and ``cross`` sites.
    """

    def __init__(self, config: Mapping[str, Any], sites: tuple[AttentionSite, ...]) -> None:
        super().__init__()
        heads, head_dim, dim = attention_dims(config)
        sample = int(config["sample_size"])
        self.patch = int(config["patch_size"])
        channels = int(config["in_channels"])
        out_channels = int(config.get("out_channels") or channels)
        interpolation = config.get("interpolation_scale") or max(sample // 64, 1)
        micro = config.get("use_additional_conditions")
        micro = sample == MICRO_CONDITIONED_SIZE if micro is None else bool(micro)
        self.pos_embed = PatchEmbed(
            channels,
            dim,
            self.patch,
            sample // self.patch,
            interpolation=interpolation,
            stored=False,
        )
        text_dim = int(config.get("cross_attention_dim") or dim)
        self.transformer_blocks = nn.ModuleList(
            PixArtBlock(dim, heads, head_dim, text_dim, sites, float(config.get("norm_eps", EPS)))
            for _ in range(int(config["num_layers"]))
        )
        self.scale_shift_table = nn.Parameter(torch.zeros(2, dim))
        self.proj_out = nn.Linear(dim, self.patch * self.patch * out_channels)
        self.adaln_single = AdaLayerNormSingle(dim, micro=micro)
        caption = config.get("caption_channels")
        self.caption_projection = (
            None if caption is None else TextProjection(int(caption), dim, tanh_gelu=True)
        )

    def forward(
        self, groups: Sequence[PixArtInputs], cache: StepCache | None = None
    ) -> list[torch.Tensor]:
        """Predict ``(B_g, C_out, h_g, w_g)`` for every group, all requests in one packed pass."""
        tokens = [self.pos_embed(g.hidden_states) for g in groups]  # (B_g, N_g, E) each
        images = [x for group in tokens for x in group]  # (N_i, E) each
        counts = [x.shape[0] for x in images]
        device = images[0].device
        modulation, embedded = self.adaln_single(
            torch.cat([g.timestep for g in groups]), _conditions(groups), images[0].dtype
        )
        text = self._text(groups)
        if cache is None:
            layout = JointLayout([0] * len(images), counts, device, self.sequence)
            x = layout.local(torch.cat(images))  # (T, E): no text, the joint rows are the image
            for block in self.transformer_blocks:
                x = block(x, modulation, text, layout)
        else:
            streams = run_cached(
                self,
                Streams(
                    text=torch.cat(text),
                    image=torch.cat(images),
                    text_counts=tuple(t.shape[0] for t in text),
                    image_counts=tuple(counts),
                    condition=modulation,
                ),
                cache,
            )
            layout, x = JointLayout([0] * len(images), counts, device), streams.image
        table = self.scale_shift_table[None] + embedded[:, None]
        shift, scale = table.unbind(1)  # (B, E) each
        out = self.proj_out(modulate(x, layout.joint_rows, shift, scale, EPS))
        stacked = regroup(layout.gather(out), counts, [len(g.timestep) for g in groups])
        return [
            unpatchify(s, g.hidden_states.shape[-2:], self.patch)
            for s, g in zip(stacked, groups, strict=True)
        ]

    def depth(self) -> int:
        """Return the blocks of the stack."""
        return len(self.transformer_blocks)

    def run_blocks(self, state: Streams, start: int, stop: int) -> Streams:
        """Run blocks ``start`` to ``stop`` on every request of ``state`` (its image rows;
        its text is what each request's cross-attention reads)."""
        layout = JointLayout(
            [0] * len(state.image_counts), state.image_counts, state.image.device, self.sequence
        )
        x = owned(layout.local(state.image), state.image)  # padding rows too
        text = list(torch.split(state.text, list(state.text_counts)))
        for block in self.transformer_blocks[start:stop]:
            x = block(x, state.condition, text, layout)
        return state._replace(image=layout.gather(x)[: sum(state.image_counts)])

    def _text(self, groups: Sequence[PixArtInputs]) -> list[torch.Tensor]:
        """Return each request's real text tokens, projected: ``(L_i, E)`` each."""
        texts = []
        for group in groups:
            mask = group.encoder_attention_mask
            for i, states in enumerate(group.encoder_hidden_states):
                texts.append(states if mask is None else states[mask[i].bool()])
        if self.caption_projection is None:
            return texts
        projected = self.caption_projection(torch.cat(texts))  # (sum L_i, E)
        return list(torch.split(projected, [t.shape[0] for t in texts]))

    def tensor_plans(self, shards: int) -> Iterator[tuple[nn.Module, TensorPlan]]:
        """Yield every block with its split."""
        for block in self.transformer_blocks:
            assert isinstance(block, PixArtBlock)
            yield block, block.tensor_plan()


def _conditions(groups: Sequence[PixArtInputs]) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Return every request's resolution ``(B, 2)`` and aspect ratio ``(B, 1)``, if given."""
    given = [g.added_cond_kwargs or {} for g in groups]
    resolutions = [c.get("resolution") for c in given]
    ratios = [c.get("aspect_ratio") for c in given]
    if any(r is None for r in resolutions) or any(r is None for r in ratios):
        return None
    return (
        torch.cat([r for r in resolutions if r is not None]),
        torch.cat([r for r in ratios if r is not None]),
    )
