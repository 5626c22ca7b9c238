"""The project's Flux DiT: diffusers' ``FluxTransformer2DModel`` on ``attention.Attention``.

Double-stream blocks keep text and image rows apart (each with its own weights) and
attend them jointly; single-stream blocks run the joint rows through one set of
weights. Joint attention is the ``self`` site over each request's text + image
tokens, with rotary embeddings applied to q and k before the kernel.
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
    gelu_,
    timestep_features,
)
from components.models.dit.layout import JointLayout, add_gated, modulate
from components.models.dit.streams import Streams, owned
from components.sites import AttentionSite

__all__ = [
    "PROJECTIONS",
    "DoubleBlock",
    "FluxInputs",
    "FluxTransformer",
    "JointInputs",
    "JointTransformer",
    "rotate",
]

# B requests, E width, H heads, D head dim, T joint rows, N_i / L_i image / text tokens

EPS = 1e-6
ROPE_THETA = 10_000
FLOAT16_MAX = 65504.0


class FluxInputs(NamedTuple):
    """One group of same-sized requests, as ``FluxTransformer2DModel.forward`` takes them."""

    hidden_states: torch.Tensor  # (B, N, C_in): latents packed 2 x 2
    encoder_hidden_states: torch.Tensor  # (B, L, joint_attention_dim)
    pooled_projections: torch.Tensor  # (B, P)
    timestep: torch.Tensor  # (B,) in [0, 1]
    img_ids: torch.Tensor  # (N, 3)
    txt_ids: torch.Tensor  # (L, 3)
    guidance: torch.Tensor | None = None  # (B,), for a guidance-distilled DiT


def rotary(ids: torch.Tensor, axes: Sequence[int]) -> torch.Tensor:
    """Return the rotation of every token ``(S, D/2)`` (complex) from its ids ``(S, len(axes))``.

    As diffusers' ``FluxPosEmbed``: per axis, frequencies in float64, angles of the
    float32 positions, rounded to float32 once.
    """
    positions = ids.float()
    parts = []
    for axis, width in enumerate(axes):
        exponent = torch.arange(0, width, 2, dtype=torch.float64, device=ids.device) / width
        angles = torch.outer(positions[:, axis], 1.0 / (ROPE_THETA**exponent))  # (S, width/2)
        parts.append(torch.polar(torch.ones_like(angles), angles).to(torch.complex64))
    return torch.cat(parts, dim=-1)


def rotate(x: torch.Tensor, rotation: torch.Tensor) -> torch.Tensor:
    """Rotate each pair of channels of ``x`` ``(T, H, D)`` by its token's ``rotation`` ``(T, D/2)``.

    Computed in float32 and returned in ``x``'s dtype, as diffusers does. A float32 ``x``
    (which the caller owns) is rotated in place; another dtype through one float32 copy.
    Under torch.compile the rotation is real arithmetic on the cosines and sines instead:
    inductor has no complex kernels, so the complex product would run apart from the
    fused code around it, between two copies.
    """
    if torch.compiler.is_compiling():
        return _rotate_real(x, rotation)
    work = x if x.dtype == torch.float32 else x.float()
    torch.view_as_complex(work.view(*x.shape[:-1], -1, 2)).mul_(rotation[:, None, :])
    return work if work is x else work.to(x.dtype)


def _rotate_real(x: torch.Tensor, rotation: torch.Tensor) -> torch.Tensor:
    """Return ``rotate(x, rotation)`` in real float32 arithmetic, as a new tensor."""
    cos, sin = torch.view_as_real(rotation)[:, None].unbind(-1)  # (T, 1, D/2) each
    real, imaginary = x.float().view(*x.shape[:-1], -1, 2).unbind(-1)  # (T, H, D/2) each
    pairs = (real * cos - imaginary * sin, real * sin + imaginary * cos)
    return torch.stack(pairs, dim=-1).flatten(-2).to(x.dtype)


class FluxTimeTextEmbedding(nn.Module):
    """The conditioning of every block: timestep (+ guidance) + pooled text, ``(B, E)``."""

    def __init__(self, dim: int, pooled: int, *, guidance: bool) -> None:
        super().__init__()
        self.timestep_embedder = TimestepEmbedding(256, dim)
        self.guidance_embedder = TimestepEmbedding(256, dim) if guidance else None
        self.text_embedder = TextProjection(pooled, dim, tanh_gelu=False)

    def forward(
        self, timestep: torch.Tensor, guidance: torch.Tensor | None, pooled: torch.Tensor
    ) -> torch.Tensor:
        """Embed ``(B,)`` timesteps (and guidance scales) and ``(B, P)`` pooled vectors."""
        condition = self.timestep_embedder(timestep_features(timestep).to(pooled.dtype))
        if self.guidance_embedder is not None:
            if guidance is None:
                raise ValueError(
                    "this Flux DiT is guidance-distilled (guidance_embeds): pass guidance"
                )
            condition = condition + self.guidance_embedder(
                timestep_features(guidance).to(pooled.dtype)
            )
        out: torch.Tensor = condition + self.text_embedder(pooled)
        return out


class DoubleBlock(nn.Module):
    """A double-stream block of a ``JointTransformer`` (``double_stream``): text and image
    rows apart, attending jointly.

    Subclasses build ``attn`` and implement ``mlps``, ``modulations`` and ``tensor_plan``.
    """

    attn: DitAttention

    def mlps(self) -> tuple[nn.Module, nn.Module]:
        """Return the text's MLP, then the image's."""
        raise NotImplementedError

    def modulations(
        self, condition: torch.Tensor
    ) -> tuple[Sequence[torch.Tensor], Sequence[torch.Tensor]]:
        """Return the text's six modulation vectors ``(B, E)``, then the image's."""
        raise NotImplementedError

    def tensor_plan(self) -> TensorPlan:
        """Return how tensor parallel splits its layers."""
        raise NotImplementedError

    def forward(
        self,
        text: torch.Tensor,
        image: torch.Tensor,
        condition: torch.Tensor,
        rotation: torch.Tensor,
        layout: JointLayout,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Update text rows ``(n_t, E)`` and image rows ``(n_i, E)`` given ``(B, E)``; in
        float16 the text is clipped to its range (both streams where ``clips_image``)."""
        streams = (text, image)
        text, image = double_stream(
            self.attn, self.mlps(), self.modulations(condition), streams, rotation, layout
        )
        if text.dtype == torch.float16:
            text = text.clip(-FLOAT16_MAX, FLOAT16_MAX)
            if self.clips_image:
                image = image.clip(-FLOAT16_MAX, FLOAT16_MAX)
        return text, image

    clips_image = False


class FluxDoubleBlock(DoubleBlock):
    """A double-stream block: text and image rows apart, attending jointly."""

    def __init__(self, dim: int, heads: int, head_dim: int, site: AttentionSite) -> None:
        super().__init__()
        self.norm1 = Modulation(dim, 6)
        self.norm1_context = Modulation(dim, 6)
        self.attn = DitAttention(
            dim, heads, head_dim, site, context=True, context_out=True, qk_norm=True, eps=EPS
        )
        self.ff = FeedForward(dim)
        self.ff_context = FeedForward(dim)

    def mlps(self) -> tuple[nn.Module, nn.Module]:
        """Return ``ff_context`` and ``ff``."""
        return self.ff_context, self.ff

    def modulations(
        self, condition: torch.Tensor
    ) -> tuple[Sequence[torch.Tensor], Sequence[torch.Tensor]]:
        """Return ``norm1_context``'s and ``norm1``'s vectors."""
        return self.norm1_context(condition), self.norm1(condition)

    def tensor_plan(self) -> TensorPlan:
        """Split heads (q, k, v column-wise, outputs row-wise) and the MLPs' hidden units."""
        plan: TensorPlan = {f"attn.{name}": "colwise" for name in PROJECTIONS}
        plan |= {"attn.to_out.0": "rowwise", "attn.to_add_out": "rowwise"}
        for ff in ("ff", "ff_context"):
            plan |= {f"{ff}.net.0.proj": "colwise", f"{ff}.net.2": "rowwise"}
        return plan


PROJECTIONS = ("to_q", "to_k", "to_v", "add_q_proj", "add_k_proj", "add_v_proj")


def double_stream(
    attn: DitAttention,
    mlps: tuple[nn.Module, nn.Module],
    modulations: tuple[Sequence[torch.Tensor], Sequence[torch.Tensor]],
    streams: tuple[torch.Tensor, torch.Tensor],
    rotation: torch.Tensor,
    layout: JointLayout,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Run a double-stream block: text and image rows apart, attending jointly.

    ``mlps``, ``modulations`` (each six ``(B, E)``: shift, scale and gate of the attention
    then of the MLP) and ``streams`` (rows ``(n_t, E)`` and ``(n_i, E)``, updated in place)
    are the text's then the image's.
    """
    text_mlp, image_mlp = mlps
    (c_shift, c_scale, c_gate, c_shift_mlp, c_scale_mlp, c_gate_mlp), image_mod = modulations
    shift, scale, gate, shift_mlp, scale_mlp, gate_mlp = image_mod
    text, image = streams
    image_rows, text_rows = layout.image.rows, layout.text.rows
    qi, ki, vi = attn.project(modulate(image, image_rows, shift, scale, EPS))
    qt, kt, vt = attn.project_context(modulate(text, text_rows, c_shift, c_scale, EPS))
    q = rotate(layout.join(qt, qi), rotation)  # (T, H, D)
    k = rotate(layout.join(kt, ki), rotation)
    o = attn.attend(q, k, layout.join(vt, vi), layout)  # (T, H * D)
    text_o, image_o = layout.split(o)
    add_gated(image, attn.output(image_o), image_rows, gate)
    h = modulate(image, image_rows, shift_mlp, scale_mlp, EPS)
    add_gated(image, image_mlp(h), image_rows, gate_mlp)
    assert attn.to_add_out is not None  # built with context_out
    add_gated(text, attn.to_add_out(text_o), text_rows, c_gate)
    h = modulate(text, text_rows, c_shift_mlp, c_scale_mlp, EPS)
    add_gated(text, text_mlp(h), text_rows, c_gate_mlp)
    return text, image


class FluxSingleBlock(nn.Module):
    """A single-stream block: the joint rows through one MLP and one attention, in parallel."""

    def __init__(self, dim: int, heads: int, head_dim: int, site: AttentionSite) -> None:
        super().__init__()
        hidden = 4 * dim
        self.norm = Modulation(dim, 3)
        self.proj_mlp = nn.Linear(dim, hidden)
        self.proj_out = nn.Linear(dim + hidden, dim)
        self.attn = DitAttention(dim, heads, head_dim, site, out=False, qk_norm=True, eps=EPS)

    def forward(
        self, x: torch.Tensor, condition: torch.Tensor, rotation: torch.Tensor, layout: JointLayout
    ) -> torch.Tensor:
        """Update joint rows ``(T, E)`` given ``(B, E)``."""
        shift, scale, gate = self.norm(condition)
        rows = layout.joint_rows
        h = modulate(x, rows, shift, scale, EPS)
        mlp = gelu_(self.proj_mlp(h))  # (T, 4E)
        q, k, v = self.attn.project(h)
        o = self.attn.attend(rotate(q, rotation), rotate(k, rotation), v, layout)  # (T, E)
        add_gated(x, self.proj_out(torch.cat([o, mlp], dim=-1)), rows, gate)
        if x.dtype == torch.float16:
            x = x.clip(-FLOAT16_MAX, FLOAT16_MAX)
        return x

    def tensor_plan(self, shards: int) -> TensorPlan:
        """Split heads and MLP units; ``proj_out`` reads both halves of each rank's share.

        Its input on a rank is that rank's attention heads then its MLP units, so its
        columns are reordered to match (a rank's attention columns, then its MLP
        columns, rank after rank) before they are split row-wise.
        """
        dim = self.proj_out.weight.shape[0]
        hidden = self.proj_mlp.weight.shape[0]
        order = torch.cat(
            [
                torch.cat([part(dim, 0, rank, shards), part(hidden, dim, rank, shards)])
                for rank in range(shards)
            ]
        )
        self.proj_out.weight = nn.Parameter(self.proj_out.weight[:, order], requires_grad=False)
        plan: TensorPlan = {f"attn.{name}": "colwise" for name in PROJECTIONS[:3]}
        return plan | {"proj_mlp": "colwise", "proj_out": "rowwise"}


def part(width: int, offset: int, rank: int, shards: int) -> torch.Tensor:
    """Return the indices of rank ``rank``'s share of ``width`` columns starting at ``offset``."""
    size = width // shards
    return torch.arange(offset + rank * size, offset + (rank + 1) * size)


class JointInputs(NamedTuple):
    """A forward's requests as a joint DiT's blocks take them, in request order."""

    texts: list[torch.Tensor]  # (L_i, E_text) each, its real tokens
    images: list[torch.Tensor]  # (N_i, C_in) each
    condition: torch.Tensor  # (B, E)
    rotation: torch.Tensor  # (sum L_i + N_i, D/2): each request's text then image


class JointTransformer(PackedTransformer):
    """A DiT of double-stream blocks (``transformer_blocks``) and, where it has them,
    single-stream blocks (``single_transformer_blocks``), requests packed: the forward,
    a step cache's parts and the tensor-parallel plans; subclasses embed.

    Subclasses build ``transformer_blocks``, ``single_transformer_blocks``, ``norm_out``
    and ``proj_out`` and implement ``joint_inputs``, ``embed_text`` and ``embed_image``.
    """

    transformer_blocks: nn.ModuleList
    single_transformer_blocks: nn.ModuleList
    norm_out: Modulation
    proj_out: nn.Linear

    def joint_inputs(self, groups: Sequence[Any]) -> JointInputs:
        """Return the requests of ``groups`` as the blocks take them."""
        raise NotImplementedError

    def embed_text(self, text: torch.Tensor) -> torch.Tensor:
        """Embed text rows ``(n, E_text)`` to ``(n, E)``."""
        raise NotImplementedError

    def embed_image(self, image: torch.Tensor) -> torch.Tensor:
        """Embed image rows ``(n, C_in)`` to ``(n, E)``."""
        raise NotImplementedError

    def forward(self, groups: Sequence[Any], cache: StepCache | None = None) -> list[torch.Tensor]:
        """Predict ``(B_g, N_g, C)`` for every group, all requests in one packed pass."""
        texts, images, condition, rotation = self.joint_inputs(groups)
        device = images[0].device
        text_counts, image_counts = [t.shape[0] for t in texts], [x.shape[0] for x in images]
        if cache is None:
            layout = JointLayout(text_counts, image_counts, device, self.sequence)
            image = self.embed_image(layout.image.take(torch.cat(images)))  # (n_i, E)
            text = self.embed_text(layout.text.take(torch.cat(texts)))  # (n_t, E)
            text, image = self._blocks(
                text, image, condition, layout.local(rotation), layout, 0, self.depth()
            )
        else:
            streams = run_cached(
                self,
                Streams(
                    text=self.embed_text(torch.cat(texts)),
                    image=self.embed_image(torch.cat(images)),
                    text_counts=tuple(text_counts),
                    image_counts=tuple(image_counts),
                    condition=condition,
                    rotation=rotation,
                ),
                cache,
            )
            layout, image = JointLayout(text_counts, image_counts, device), streams.image
        scale, shift = self.norm_out(condition)
        out = self.proj_out(modulate(image, layout.image.rows, shift, scale, EPS))
        sizes = [len(g.timestep) for g in groups]
        return regroup(layout.gather_image(out), image_counts, sizes)

    def depth(self) -> int:
        """Return the double-stream blocks then the single-stream ones."""
        return len(self.transformer_blocks) + len(self.single_transformer_blocks)

    def run_blocks(self, state: Streams, start: int, stop: int) -> Streams:
        """Run blocks ``start`` to ``stop`` (double-stream first) on every request of ``state``."""
        layout = JointLayout(
            state.text_counts, state.image_counts, state.image.device, self.sequence
        )
        assert state.rotation is not None  # a joint DiT's streams carry their rotation
        text, image = self._blocks(
            owned(layout.text.take(state.text), state.text),
            owned(layout.image.take(state.image), state.image),
            state.condition,
            layout.local(state.rotation),
            layout,
            start,
            stop,
        )
        text, image = layout.gather_streams(text, image)
        return state._replace(text=text, image=image)

    def _blocks(
        self,
        text: torch.Tensor,
        image: torch.Tensor,
        condition: torch.Tensor,
        rotation: torch.Tensor,
        layout: JointLayout,
        start: int,
        stop: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Run blocks ``start`` to ``stop`` on this rank's text ``(n_t, E)`` and image rows."""
        doubles = len(self.transformer_blocks)
        for double in self.transformer_blocks[start:stop]:
            text, image = double(text, image, condition, rotation, layout)
        if stop <= doubles:
            return text, image
        x = layout.join(text, image)
        for single in self.single_transformer_blocks[max(start - doubles, 0) : stop - doubles]:
            x = single(x, condition, rotation, layout)
        return layout.split(x)

    def tensor_plans(self, shards: int) -> Iterator[tuple[nn.Module, TensorPlan]]:
        """Yield both stacks' blocks with their splits over ``shards`` ranks."""
        for double in self.transformer_blocks:
            assert isinstance(double, DoubleBlock)
            yield double, double.tensor_plan()
        for single in self.single_transformer_blocks:
            assert isinstance(single, FluxSingleBlock)
            yield single, single.tensor_plan(shards)


class FluxTransformer(JointTransformer):
    """Flux's DiT: the names, shapes and arithmetic of diffusers' class, requests packed.

    Args:
        config: the folder's ``config.json`` of ``FluxTransformer2DModel``.
        site: the declared ``self`` site (joint attention).
    """

    def __init__(self, config: Mapping[str, Any], site: AttentionSite) -> None:
        super().__init__()
        heads, head_dim, dim = attention_dims(config)
        patch = int(config.get("patch_size", 1))
        out_channels = int(config.get("out_channels") or config["in_channels"])
        self.axes = tuple(int(a) for a in config["axes_dims_rope"])
        self.time_text_embed = FluxTimeTextEmbedding(
            dim, int(config["pooled_projection_dim"]), guidance=bool(config["guidance_embeds"])
        )
        self.context_embedder = nn.Linear(int(config["joint_attention_dim"]), dim)
        self.x_embedder = nn.Linear(int(config["in_channels"]), dim)
        self.transformer_blocks = nn.ModuleList(
            FluxDoubleBlock(dim, heads, head_dim, site) for _ in range(int(config["num_layers"]))
        )
        self.single_transformer_blocks = nn.ModuleList(
            FluxSingleBlock(dim, heads, head_dim, site)
            for _ in range(int(config["num_single_layers"]))
        )
        self.norm_out = Modulation(dim, 2)
        self.proj_out = nn.Linear(dim, patch * patch * out_channels)

    def joint_inputs(self, groups: Sequence[FluxInputs]) -> JointInputs:
        """Return each request's text, image rows, conditioning and rotation."""
        images = [x for group in groups for x in group.hidden_states]  # (N_i, C_in) each
        condition = self.time_text_embed(
            torch.cat([g.timestep for g in groups]).to(images[0].dtype) * 1000,
            _guidance(groups, images[0].dtype),
            torch.cat([g.pooled_projections for g in groups]),
        )  # (B, E)
        rotation = torch.cat(
            [
                rotary(torch.cat([g.txt_ids, g.img_ids]), self.axes)
                .expand(len(g.timestep), -1, -1)
                .flatten(0, 1)
                for g in groups
            ]
        )  # (sum L_i + N_i, D/2)
        texts = [c for group in groups for c in group.encoder_hidden_states]  # (L_i, E_j)
        return JointInputs(texts, images, condition, rotation)

    def embed_text(self, text: torch.Tensor) -> torch.Tensor:
        """Project T5's states to the model width (``context_embedder``)."""
        out: torch.Tensor = self.context_embedder(text)
        return out

    def embed_image(self, image: torch.Tensor) -> torch.Tensor:
        """Project packed latents to the model width (``x_embedder``)."""
        out: torch.Tensor = self.x_embedder(image)
        return out


def _guidance(groups: Sequence[FluxInputs], dtype: torch.dtype) -> torch.Tensor | None:
    """Return every request's guidance scale times 1000 ``(B,)``, or None when no group has one."""
    scales = [g.guidance for g in groups]
    if any(s is None for s in scales):
        return None
    return torch.cat([s for s in scales if s is not None]).to(dtype) * 1000
