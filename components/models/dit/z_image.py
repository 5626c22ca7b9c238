"""The project's Z-Image DiT: diffusers' ``ZImageTransformer2DModel``, on ``Attention``.

A single-stream DiT in three stacks: image tokens pass the ``noise_refiner`` blocks
(modulated by the timestep) among themselves, text tokens the ``context_refiner`` blocks
(not modulated) among themselves, then each request's text and image run as one
sequence through the main ``layers``. Each part of a request is padded to a multiple of
``SEQ_MULTI_OF`` tokens with a learnt pad token (``x_pad_token``, ``cap_pad_token``), and
the pads attend and are attended to as diffusers' call has them: the text's pads carry
on the text's positions, the image's sit at position (0, 0, 0). Rotary embeddings are
per axis (frame, height, width), the text on the frame axis from 1 and the image one
frame past the padded text. Diffusers' joint order is image then text; attention does
not depend on the order of a request's tokens, so the packed sequence keeps the
project's text-first order.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any, NamedTuple

import torch
from torch import nn
from torch.nn.functional import layer_norm, silu

from components.cache import StepCache, run_cached
from components.models.dit.attention import DitAttention
from components.models.dit.base import PackedTransformer, TensorPlan
from components.models.dit.flux import rotate
from components.models.dit.layers import timestep_features
from components.models.dit.layout import JointLayout, Rows, add_gated
from components.models.dit.streams import Streams, owned
from components.sites import AttentionSite

__all__ = ["ZImageInputs", "ZImageTransformer", "unsupported"]

# B requests, C channels, E width, D head dim, T joint rows, F h w latent frames and grid,
# N_i / L_i image / text tokens of request i (padded)

SEQ_MULTI_OF = 32
"""Each request's image and text are padded to a multiple of this many tokens."""
ADALN_WIDTH = 256
"""The timestep embedding's width (the model's, where narrower)."""
TIME_HIDDEN = 1024
"""The timestep embedder's hidden width."""
QK_EPS = 1e-5
"""The epsilon of the per-head query and key norms (diffusers' ``Attention`` default here)."""
FINAL_EPS = 1e-6
PATCH = (2, 1)
"""The patch side and frames diffusers' call takes by default (``patch_size``, ``f_patch_size``)."""


class ZImageInputs(NamedTuple):
    """One group's arguments to ``ZImageTransformer2DModel``, as diffusers' call passes them."""

    x: list[torch.Tensor]  # (C, F, h, w) per image
    t: torch.Tensor  # (B,) in [0, 1], 1 at the clean end
    cap_feats: list[torch.Tensor]  # (L_i, cap_feat_dim) per image, its real tokens


def padding(count: int) -> int:
    """Return the pad tokens that bring ``count`` to a multiple of ``SEQ_MULTI_OF``."""
    return -count % SEQ_MULTI_OF


def feed_forward_units(dim: int) -> int:
    """Return the hidden units of a block's feed-forward: 8/3 of the width, rounded down."""
    return int(dim / 3 * 8)


def rotation(ids: torch.Tensor, axes: Sequence[int], theta: float) -> torch.Tensor:
    """Return the rotation ``(S, D/2)`` (complex) of tokens at integer positions ``ids``
    ``(S, len(axes))``, as diffusers' ``RopeEmbedder`` looks it up: per axis, angles in
    float64 rounded to float32, then turned."""
    parts = []
    for axis, width in enumerate(axes):
        exponent = torch.arange(0, width, 2, dtype=torch.float64, device=ids.device) / width
        angles = torch.outer(ids[:, axis].double(), 1.0 / theta**exponent).float()
        parts.append(torch.polar(torch.ones_like(angles), angles))
    return torch.cat(parts, dim=-1)


def grid_ids(start: Sequence[int], size: Sequence[int], device: torch.device) -> torch.Tensor:
    """Return the positions ``(prod(size), 3)`` of a (frames, rows, columns) grid from ``start``."""
    axes = [torch.arange(a, a + n, device=device) for a, n in zip(start, size, strict=True)]
    return torch.stack(torch.meshgrid(axes, indexing="ij"), dim=-1).flatten(0, 2)


def scale_rows_(x: torch.Tensor, rows: Rows, scale: torch.Tensor) -> torch.Tensor:
    """Multiply each request's rows of ``x`` ``(n, E)`` by its ``scale`` ``(B, E)`` in place
    (padding rows as they are): ``x`` is a norm's fresh output, never copied again."""
    owner = rows.owner
    if owner is not None:
        return x.mul_(scale[owner])
    for i, a, b in rows.spans():
        x[a:b].mul_(scale[i])
    return x


class SwiGlu(nn.Module):
    """Z-Image's feed-forward: ``w2(silu(w1(x)) * w3(x))``, no biases."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Map ``(n, E)`` to ``(n, E)``."""
        out: torch.Tensor = self.w2(silu(self.w1(x)) * self.w3(x))
        return out


class ZImageBlock(nn.Module):
    """A Z-Image block: attention then feed-forward, each between two RMS norms; modulated
    by the timestep (scale and tanh gate) unless it refines the text.

    Args:
        dim: the width E.
        heads: attention heads.
        site: the declared ``self`` site.
        eps: the RMS norms' epsilon (``norm_eps``).
        qk_norm: queries and keys are RMS-normalised per head.
        modulated: it has ``adaLN_modulation`` (every stack but ``context_refiner``).
    """

    def __init__(
        self,
        dim: int,
        heads: int,
        site: AttentionSite,
        eps: float,
        *,
        qk_norm: bool,
        modulated: bool,
    ) -> None:
        super().__init__()
        self.attention = DitAttention(
            dim, heads, dim // heads, site, qk_norm=qk_norm, eps=QK_EPS, bias=False
        )
        self.feed_forward = SwiGlu(dim, feed_forward_units(dim))
        self.attention_norm1 = nn.RMSNorm(dim, eps=eps)
        self.ffn_norm1 = nn.RMSNorm(dim, eps=eps)
        self.attention_norm2 = nn.RMSNorm(dim, eps=eps)
        self.ffn_norm2 = nn.RMSNorm(dim, eps=eps)
        self.adaLN_modulation = (
            nn.Sequential(nn.Linear(min(dim, ADALN_WIDTH), 4 * dim)) if modulated else None
        )

    def forward(
        self,
        x: torch.Tensor,
        condition: torch.Tensor,
        rotation: torch.Tensor,
        layout: JointLayout,
    ) -> torch.Tensor:
        """Update joint rows ``(T, E)`` given the timestep's embedding ``(B, E_t)``."""
        if self.adaLN_modulation is None:
            x = x + self.attention_norm2(self._attend(self.attention_norm1(x), rotation, layout))
            out: torch.Tensor = x + self.ffn_norm2(self.feed_forward(self.ffn_norm1(x)))
            return out
        rows = layout.joint_rows
        scale, gate, scale_mlp, gate_mlp = self.adaLN_modulation(condition).chunk(4, dim=1)
        h = scale_rows_(self.attention_norm1(x), rows, 1.0 + scale)
        add_gated(x, self.attention_norm2(self._attend(h, rotation, layout)), rows, gate.tanh())
        h = scale_rows_(self.ffn_norm1(x), rows, 1.0 + scale_mlp)
        return add_gated(x, self.ffn_norm2(self.feed_forward(h)), rows, gate_mlp.tanh())

    def _attend(self, h: torch.Tensor, rotation: torch.Tensor, layout: JointLayout) -> torch.Tensor:
        """Attend each request's rows of ``h`` ``(T, E)`` to its own, rotated: ``(T, E)``."""
        q, k, v = self.attention.project(h)
        o = self.attention.attend(rotate(q, rotation), rotate(k, rotation), v, layout)
        return self.attention.output(o)

    def tensor_plan(self) -> TensorPlan:
        """Split heads (q, k, v column-wise, the output row-wise) and the feed-forward's units."""
        plan: TensorPlan = {f"attention.to_{p}": "colwise" for p in "qkv"}
        plan |= {"attention.to_out.0": "rowwise", "feed_forward.w2": "rowwise"}
        return plan | {"feed_forward.w1": "colwise", "feed_forward.w3": "colwise"}


class TimestepEmbedder(nn.Module):
    """diffusers' Z-Image ``TimestepEmbedder``: sinusoids, then ``mlp`` (Linear, SiLU, Linear)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.mlp = nn.Sequential(
            nn.Linear(ADALN_WIDTH, TIME_HIDDEN), nn.SiLU(), nn.Linear(TIME_HIDDEN, dim)
        )

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        """Embed ``(B,)`` scaled timesteps: ``(B, E_t)`` in the weights' dtype."""
        first = self.mlp[0]
        assert isinstance(first, nn.Linear)
        features = timestep_features(t).to(first.weight.dtype)
        out: torch.Tensor = self.mlp(features)
        return out


class FinalLayer(nn.Module):
    """The last layer: a layer norm scaled by the timestep (``adaLN_modulation``), ``linear``."""

    def __init__(self, dim: int, out: int) -> None:
        super().__init__()
        self.linear = nn.Linear(dim, out)
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(min(dim, ADALN_WIDTH), dim))

    def forward(self, x: torch.Tensor, rows: Rows, condition: torch.Tensor) -> torch.Tensor:
        """Map image rows ``(n, E)`` to patches ``(n, p * p * F_p * C)``."""
        h = layer_norm(x, (x.shape[-1],), eps=FINAL_EPS)
        scale = 1.0 + self.adaLN_modulation(condition)
        out: torch.Tensor = self.linear(scale_rows_(h, rows, scale))
        return out


class Tokens(NamedTuple):
    """A forward's requests embedded and padded, as the refiners take them, in request order."""

    images: list[torch.Tensor]  # (N_i, E) each, pads included
    texts: list[torch.Tensor]  # (L_i, E) each, pads included
    image_rotations: list[torch.Tensor]  # (N_i, D/2) each
    text_rotations: list[torch.Tensor]  # (L_i, D/2) each
    condition: torch.Tensor  # (B, E_t)
    real: list[int]  # each request's image tokens before padding


class ZImageTransformer(PackedTransformer):
    """Z-Image's DiT: the names, shapes and arithmetic of diffusers' class, requests packed.

    Args:
        config: the folder's ``config.json`` of ``ZImageTransformer2DModel``.
        site: the declared ``self`` site (every stack's attention).
    """

    def __init__(self, config: Mapping[str, Any], site: AttentionSite) -> None:
        super().__init__()
        dim, heads = int(config["dim"]), int(config["n_heads"])
        self.dim = dim
        eps = float(config["norm_eps"])
        qk_norm = bool(config["qk_norm"])
        self.channels = int(config["in_channels"])
        self.axes = tuple(int(a) for a in config["axes_dims"])
        self.theta = float(config["rope_theta"])
        self.t_scale = float(config["t_scale"])
        pairs = list(zip(config["all_patch_size"], config["all_f_patch_size"], strict=True))
        self.all_x_embedder = nn.ModuleDict(
            {f"{p}-{f}": nn.Linear(f * p * p * self.channels, dim) for p, f in pairs}
        )
        self.all_final_layer = nn.ModuleDict(
            {f"{p}-{f}": FinalLayer(dim, p * p * f * self.channels) for p, f in pairs}
        )

        def stack(count: int, *, modulated: bool) -> nn.ModuleList:
            return nn.ModuleList(
                ZImageBlock(dim, heads, site, eps, qk_norm=qk_norm, modulated=modulated)
                for _ in range(count)
            )

        refiners = int(config["n_refiner_layers"])
        self.noise_refiner = stack(refiners, modulated=True)
        self.context_refiner = stack(refiners, modulated=False)
        self.t_embedder = TimestepEmbedder(min(dim, ADALN_WIDTH))
        cap = int(config["cap_feat_dim"])
        self.cap_embedder = nn.Sequential(nn.RMSNorm(cap, eps=eps), nn.Linear(cap, dim))
        self.x_pad_token = nn.Parameter(torch.zeros(1, dim))
        self.cap_pad_token = nn.Parameter(torch.zeros(1, dim))
        self.layers = stack(int(config["n_layers"]), modulated=True)

    def forward(
        self, groups: Sequence[ZImageInputs], cache: StepCache | None = None
    ) -> list[torch.Tensor]:
        """Predict ``(B_g, C, F, h, w)`` for every group, all requests in one packed pass."""
        tokens = self.tokens(groups)
        condition = tokens.condition
        image = self._refine(self.noise_refiner, tokens.images, tokens.image_rotations, condition)
        text = self._refine(self.context_refiner, tokens.texts, tokens.text_rotations, condition)
        text_counts = [t.shape[0] for t in tokens.texts]
        image_counts = [x.shape[0] for x in tokens.images]
        pairs = zip(tokens.text_rotations, tokens.image_rotations, strict=True)
        joint_rotation = torch.cat([r for pair in pairs for r in pair])  # text, then image
        device = image.device
        if cache is None:
            layout = JointLayout(text_counts, image_counts, device, self.sequence)
            x = layout.join(layout.text.take(text), layout.image.take(image))  # (T, E)
            x = self._layers(x, condition, layout.local(joint_rotation), layout, 0, self.depth())
            image = layout.split(x)[1]
        else:
            streams = Streams(
                text=text,
                image=image,
                text_counts=tuple(text_counts),
                image_counts=tuple(image_counts),
                condition=condition,
                rotation=joint_rotation,
            )
            image = run_cached(self, streams, cache).image
            layout = JointLayout(text_counts, image_counts, device)
        final = self.all_final_layer[_key()]
        out = layout.gather_image(final(image, layout.image.rows, condition))  # (sum N_i, ...)
        return self._unpatchified(out, image_counts, tokens.real, groups)

    def tokens(self, groups: Sequence[ZImageInputs]) -> Tokens:
        """Embed every request's image patches and text, padded, with their rotations."""
        patch, frames = PATCH
        latents = [x for group in groups for x in group.x]  # (C, F, h, w) each
        captions = [c for group in groups for c in group.cap_feats]  # (L_i, cap_feat_dim)
        device = latents[0].device
        patches = [_patchify(x, patch, frames) for x in latents]  # (N_i real, p * p * F_p * C)
        real = [p.shape[0] for p in patches]
        images = _padded(self.all_x_embedder[_key()](torch.cat(patches)), real, self.x_pad_token)
        lengths = [c.shape[0] for c in captions]
        texts = _padded(self.cap_embedder(torch.cat(captions)), lengths, self.cap_pad_token)
        text_rotations, image_rotations = [], []
        for text, x in zip(texts, latents, strict=True):
            padded = text.shape[0]
            text_ids = grid_ids((1, 0, 0), (padded, 1, 1), device)
            grid = (x.shape[1] // frames, x.shape[2] // patch, x.shape[3] // patch)
            image_ids = grid_ids((padded + 1, 0, 0), grid, device)
            pads = image_ids.new_zeros(padding(image_ids.shape[0]), 3)  # at (0, 0, 0)
            text_rotations.append(rotation(text_ids, self.axes, self.theta))
            image_rotations.append(rotation(torch.cat([image_ids, pads]), self.axes, self.theta))
        t = torch.cat([g.t for g in groups])
        condition = self.t_embedder(t * self.t_scale).to(latents[0].dtype)
        return Tokens(images, texts, image_rotations, text_rotations, condition, real)

    def _refine(
        self,
        blocks: nn.ModuleList,
        parts: Sequence[torch.Tensor],
        rotations: Sequence[torch.Tensor],
        condition: torch.Tensor,
    ) -> torch.Tensor:
        """Run a refiner stack over each request's ``parts`` ``(n_i, E)`` alone (its image or
        its text); return every request's rows whole ``(sum n_i, E)``."""
        counts = [p.shape[0] for p in parts]
        layout = JointLayout([0] * len(parts), counts, parts[0].device, self.sequence)
        x = layout.local(torch.cat(list(parts)))  # (T, E)
        rotation = layout.local(torch.cat(list(rotations)))
        for block in blocks:
            x = block(x, condition, rotation, layout)
        return layout.gather(x)

    def _layers(
        self,
        x: torch.Tensor,
        condition: torch.Tensor,
        rotation: torch.Tensor,
        layout: JointLayout,
        start: int,
        stop: int,
    ) -> torch.Tensor:
        """Run main layers ``start`` to ``stop`` on this rank's joint rows ``(T, E)``."""
        for block in self.layers[start:stop]:
            x = block(x, condition, rotation, layout)
        return x

    def _unpatchified(
        self,
        out: torch.Tensor,
        counts: Sequence[int],
        real: Sequence[int],
        groups: Sequence[ZImageInputs],
    ) -> list[torch.Tensor]:
        """Return each group's latents ``(B_g, C, F, h, w)`` from every request's image rows."""
        patch, frames = PATCH
        rows = iter(torch.split(out, list(counts)))
        sizes = iter(real)
        stacked = []
        for group in groups:
            images = []
            for x in group.x:
                c, f, h, w = x.shape
                tokens = next(rows)[: next(sizes)]
                grid = tokens.view(f // frames, h // patch, w // patch, frames, patch, patch, c)
                images.append(grid.permute(6, 0, 3, 1, 4, 2, 5).reshape(c, f, h, w))
            stacked.append(torch.stack(images))
        return stacked

    def depth(self) -> int:
        """Return the main layers (what a step cache runs in parts; the refiners run first)."""
        return len(self.layers)

    def run_blocks(self, state: Streams, start: int, stop: int) -> Streams:
        """Run main layers ``start`` to ``stop`` on every request of ``state``."""
        layout = JointLayout(
            state.text_counts, state.image_counts, state.image.device, self.sequence
        )
        assert state.rotation is not None  # Z-Image's streams carry their rotation
        x = layout.join(
            owned(layout.text.take(state.text), state.text),
            owned(layout.image.take(state.image), state.image),
        )
        x = self._layers(x, state.condition, layout.local(state.rotation), layout, start, stop)
        text, image = layout.gather_streams(*layout.split(x))
        return state._replace(text=text, image=image)

    def tensor_plans(self, shards: int) -> Iterator[tuple[nn.Module, TensorPlan]]:
        """Yield every block of the three stacks with its split."""
        for stack in (self.noise_refiner, self.context_refiner, self.layers):
            for block in stack:
                assert isinstance(block, ZImageBlock)
                yield block, block.tensor_plan()


def _key() -> str:
    """Return the ``all_x_embedder`` (and ``all_final_layer``) entry of the default patch."""
    patch, frames = PATCH
    return f"{patch}-{frames}"


def _patchify(x: torch.Tensor, patch: int, frames: int) -> torch.Tensor:
    """Return the patches of latents ``(C, F, h, w)``: ``(F/f * h/p * w/p, f * p * p * C)``."""
    c, f, h, w = x.shape
    x = x.view(c, f // frames, frames, h // patch, patch, w // patch, patch)
    return x.permute(1, 3, 5, 2, 4, 6, 0).reshape(-1, frames * patch * patch * c)


def _padded(embedded: torch.Tensor, counts: Sequence[int], pad: torch.Tensor) -> list[torch.Tensor]:
    """Split embedded rows ``(sum n_i, E)`` per request, each padded with ``pad`` ``(1, E)``."""
    return [
        torch.cat([rows, pad.expand(padding(rows.shape[0]), -1)])
        for rows in torch.split(embedded, list(counts))
    ]


def unsupported(config: Mapping[str, Any]) -> str | None:
    """Say what of ``config`` this module does not build (Omni's SigLIP branch, a DiT without
    the default patch), or None."""
    if config.get("siglip_feat_dim") is not None:
        return "siglip_feat_dim (Z-Image Omni's image conditioning)"
    pairs = list(zip(config["all_patch_size"], config["all_f_patch_size"], strict=True))
    if PATCH not in [(int(p), int(f)) for p, f in pairs]:
        return "patches other than diffusers' default 2 x 2, one frame (all_patch_size)"
    return None
