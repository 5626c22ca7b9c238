"""The project's Wan DiT: diffusers' ``WanTransformer3DModel`` (Wan 2.1, 2.2) on ``Attention``.

Latents ``(C, f, h, w)`` are cut into patches (``patch_embedding``, a strided 3D
convolution) whose tokens attend to each other (site ``self``, every request's video
tokens packed into one sequence) with 3D rotary positions (frame, row, column), then to
their request's UMT5 text (site ``cross``), and, for Wan 2.1 image to video, to its CLIP
image states through added key and value projections. Each block is modulated by the
timestep: one per video, or one per token (Wan 2.2 TI2V, ``expand_timesteps``). Queries
and keys are RMS-normalised across all heads, so under tensor parallel the squares are
summed over the ranks that hold the heads.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.functional import layer_norm, silu

from components.cache import StepCache
from components.mesh import ComponentParallel
from components.models.dit.attention import DitAttention
from components.models.dit.base import PackedTransformer, TensorPlan, attention_dims, regroup
from components.models.dit.layers import (
    FeedForward,
    TextProjection,
    TimestepEmbedding,
    timestep_features,
)
from components.models.dit.layout import JointLayout, Rows
from components.sites import AttentionSite

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["WanInputs", "WanTransformer", "unsupported"]

# B requests, C channels, E width, H heads, D head dim, f h w latent grid, N_i video tokens of
# request i, n rows on this rank, L text tokens, P image tokens

EPS = 1e-6
"""The norms' epsilon where the config gives no ``eps``."""
IMAGE_EPS = 1e-5
"""The epsilon of the image embedder's norms (``FP32LayerNorm``'s default)."""
ROPE_THETA = 10_000.0


class WanInputs(NamedTuple):
    """One group's arguments to Wan's DiT, as ``WanTransformer3DModel.forward`` takes them."""

    hidden_states: torch.Tensor  # (B, C_in, f, h, w)
    timestep: torch.Tensor  # (B,), or (B, N) with expand_timesteps
    encoder_hidden_states: torch.Tensor  # (B, L, E_text)
    encoder_hidden_states_image: torch.Tensor | None = None  # (B, P, E_image); (2B, P, ..) pairs


class WanRotaryTables(nn.Module):
    """diffusers' ``WanRotaryPosEmbed``: cosines and sines of every position up to
    ``rope_max_seq_len`` on each axis (frame, row, column), computed in float64, each
    repeated for the two channels of a pair; the head's channels split among the axes.
    """

    def __init__(self, head_dim: int, positions: int) -> None:
        super().__init__()
        side = 2 * (head_dim // 6)
        self.axes = (head_dim - 2 * side, side, side)
        self.positions = positions
        angles = torch.cat(
            [
                torch.outer(
                    torch.arange(positions, dtype=torch.float64),
                    1.0 / ROPE_THETA ** (torch.arange(0, width, 2, dtype=torch.float64) / width),
                )
                for width in self.axes
            ],
            dim=1,
        )  # (positions, D/2)
        self.register_buffer("freqs_cos", angles.cos().repeat_interleave(2, 1).float(), False)
        self.register_buffer("freqs_sin", angles.sin().repeat_interleave(2, 1).float(), False)

    def rotation(self, grid: tuple[int, int, int]) -> torch.Tensor:
        """Return the rotation of every token of a ``grid`` (frames, rows, columns) of
        patches, row-major: cosines then sines ``(f * h * w, 2, D/2)``.

        Raises:
            ValueError: a side of the grid is longer than the tables (the message names both).
        """
        if max(grid) > self.positions:
            raise ValueError(
                f"a grid of {grid[0]} x {grid[1]} x {grid[2]} patches (frames x rows x columns) "
                f"is longer than the Wan DiT's rotary tables ({self.positions} positions, "
                "rope_max_seq_len); ask for fewer frames or a smaller size"
            )
        parts = []
        for table in (self.freqs_cos, self.freqs_sin):
            assert isinstance(table, torch.Tensor)  # a buffer
            axes = torch.split(table[:, 0::2], [width // 2 for width in self.axes], dim=1)
            shape = (*grid, -1)
            parts.append(
                torch.cat(
                    [
                        axes[0][: grid[0], None, None].expand(shape),
                        axes[1][None, : grid[1], None].expand(shape),
                        axes[2][None, None, : grid[2]].expand(shape),
                    ],
                    dim=-1,
                ).flatten(0, 2)
            )
        return torch.stack(parts, dim=1)


def rotate(x: torch.Tensor, rotation: torch.Tensor) -> torch.Tensor:
    """Rotate each pair of channels of ``x`` ``(n, H, D)`` by its row's ``rotation``
    ``(n, 2, D/2)`` (cosines, sines), as diffusers' Wan does: each product rounded apart (a
    complex product fuses them, and differs in the last bit)."""
    cos, sin = rotation[:, None, 0], rotation[:, None, 1]  # (n, 1, D/2)
    pairs = x.view(*x.shape[:-1], -1, 2)
    first, second = pairs[..., 0], pairs[..., 1]  # (n, H, D/2) each
    out = torch.empty_like(pairs)
    out[..., 0] = first * cos - second * sin
    out[..., 1] = first * sin + second * cos
    return out.view(x.shape)


class HeadsRMSNorm(nn.RMSNorm):
    """diffusers' ``RMSNorm`` of all heads' channels together (``rms_norm_across_heads``).

    Under tensor parallel a rank holds its heads' channels only: the squares are summed
    over the ranks of ``tensor`` and the rank's share of the weight is applied.
    """

    tensor: DeviceMesh | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Normalise ``(n, channels)`` (this rank's channels under tensor parallel)."""
        if self.tensor is None:
            return super().forward(x)
        assert self.weight is not None  # built with both
        assert self.eps is not None
        width = x.shape[-1]
        squares = x.float().pow(2).sum(-1, keepdim=True)
        dist.all_reduce(squares, group=self.tensor.get_group())
        start = self.tensor.get_local_rank() * width
        scale = torch.rsqrt(squares / self.weight.shape[0] + self.eps)
        return (x.float() * scale).to(x.dtype) * self.weight[start : start + width]


class WanAttention(DitAttention):
    """A Wan attention: queries and keys normalised across heads, and where ``image`` is
    given (Wan 2.1 I2V) added key and value projections of the image states."""

    def __init__(
        self,
        dim: int,
        heads: int,
        head_dim: int,
        site: AttentionSite,
        image: int | None,
        eps: float,
    ) -> None:
        super().__init__(dim, heads, head_dim, site)
        inner = heads * head_dim
        self.norm_q = HeadsRMSNorm(inner, eps=eps)
        self.norm_k = HeadsRMSNorm(inner, eps=eps)
        self.image = image is not None
        if image is not None:
            self.add_k_proj = nn.Linear(image, inner)
            self.add_v_proj = nn.Linear(image, inner)
            self.norm_added_k = HeadsRMSNorm(inner, eps=eps)

    def _keys(self, x: torch.Tensor, image: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """Project text (or image) rows ``(L, E)`` to normalised keys and values ``(L, H, D)``."""
        if image:
            key, value, norm = self.add_k_proj(x), self.add_v_proj(x), self.norm_added_k
        else:
            key, value, norm = self.to_k(x), self.to_v(x), self.norm_k
        assert norm is not None  # built above
        return self._heads(norm(key)), self._heads(value)

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Project video rows ``(n, E)`` to q, k, v ``(n, H, D)`` (q and k normalised)."""
        assert self.norm_q is not None
        k, v = self._keys(x, image=False)
        return self._heads(self.norm_q(self.to_q(x))), k, v

    def cross_context(
        self, h: torch.Tensor, rows: Rows, texts: Sequence[torch.Tensor], images: Sequence[Any]
    ) -> torch.Tensor:
        """Attend each request's rows of ``h`` ``(n, E)`` to its text ``(L_i, E)`` (and, with
        added projections, apart to its image states ``(P_i, E)``, the two summed): ``(n, E)``.

        Padding rows (sequence parallel) attend to nothing and get zeros.
        """
        assert self.norm_q is not None
        outs = []
        for i, a, b in rows.spans():
            q = self._heads(self.norm_q(self.to_q(h[a:b])))
            o = self._dense(q, *self._keys(texts[i], image=False))
            if self.image:
                o = o + self._dense(q, *self._keys(images[i], image=True))
            outs.append(o.flatten(-2))
        out = self.output(torch.cat(outs)) if outs else h.new_zeros(0, h.shape[-1])
        if rows.padding:
            out = torch.cat([out, out.new_zeros(rows.padding, out.shape[-1])])
        return out

    def tensor_plan(self, name: str) -> TensorPlan:
        """Split heads: the projections into heads column-wise, ``to_out.0`` row-wise."""
        plan: TensorPlan = {f"{name}.to_{p}": "colwise" for p in "qkv"}
        if self.image:
            plan |= {f"{name}.add_k_proj": "colwise", f"{name}.add_v_proj": "colwise"}
        return plan | {f"{name}.to_out.0": "rowwise"}


class Conditioning(NamedTuple):
    """The timestep's embedding, per video or per token (then over this rank's rows).

    Attributes:
        embedded: ``temb`` ``(B, E)`` or ``(n, E)``.
        projected: the six modulation vectors ``(B, 6, E)`` or ``(n, 6, E)``.
        per_row: one per token rather than one per request.
    """

    embedded: torch.Tensor
    projected: torch.Tensor
    per_row: bool


def modulated(
    x: torch.Tensor, rows: Rows, shift: torch.Tensor, scale: torch.Tensor, per_row: bool, eps: float
) -> torch.Tensor:
    """Layer-normalise ``x`` ``(n, E)`` in float32 and modulate it by each request's ``(B, E)``
    values, or each row's ``(n, E)`` (``per_row``), in diffusers' order of operations.

    Padding rows (sequence parallel) are normalised alone.
    """
    normed = layer_norm(x.float(), (x.shape[-1],), eps=eps)
    if per_row:
        normed.mul_(1 + scale).add_(shift)
    else:
        for i, a, b in rows.spans():
            normed[a:b].mul_(1 + scale[i]).add_(shift[i])
    return normed.to(x.dtype)


def gated(x: torch.Tensor, y: torch.Tensor, rows: Rows, gate: torch.Tensor, per_row: bool) -> None:
    """Add ``y`` times each request's (or each row's) ``gate`` to ``x`` in place, the product
    rounded first, as diffusers adds it."""
    if per_row:
        x.add_(y * gate)
        return
    for i, a, b in rows.spans():
        x[a:b].add_(y[a:b] * gate[i])


class WanBlock(nn.Module):
    """A Wan block: modulated self-attention, cross-attention, modulated feed-forward."""

    def __init__(
        self,
        config: Mapping[str, Any],
        sites: tuple[AttentionSite, ...],
    ) -> None:
        super().__init__()
        heads, head_dim, dim = attention_dims(config)
        eps = float(config.get("eps", EPS))
        added = config.get("added_kv_proj_dim")
        self_site, cross_site = sites
        self.eps = eps
        self.attn1 = WanAttention(dim, heads, head_dim, self_site, None, eps)
        self.attn2 = WanAttention(
            dim, heads, head_dim, cross_site, None if added is None else int(added), eps
        )
        self.norm2 = nn.LayerNorm(dim, eps) if config.get("cross_attn_norm", True) else None
        self.ffn = FeedForward(dim, inner=int(config["ffn_dim"]))
        self.scale_shift_table = nn.Parameter(torch.zeros(1, 6, dim))

    def forward(
        self,
        x: torch.Tensor,
        condition: Conditioning,
        context: tuple[Sequence[torch.Tensor], Sequence[Any]],
        rotation: torch.Tensor,
        layout: JointLayout,
    ) -> torch.Tensor:
        """Update video rows ``(n, E)`` given the timestep's ``condition`` and each request's
        text (and image states) in ``context``."""
        table = self.scale_shift_table + condition.projected.float()  # (B or n, 6, E)
        shift, scale, gate, c_shift, c_scale, c_gate = table.unbind(1)
        rows, per_row = layout.joint_rows, condition.per_row
        q, k, v = self.attn1.project(modulated(x, rows, shift, scale, per_row, self.eps))
        o = self.attn1.attend(rotate(q, rotation), rotate(k, rotation), v, layout)
        gated(x, self.attn1.output(o), rows, gate, per_row)
        h = x if self.norm2 is None else self.norm2(x)
        x.add_(self.attn2.cross_context(h, rows, *context))
        h = modulated(x, rows, c_shift, c_scale, per_row, self.eps)
        gated(x, self.ffn(h), rows, c_gate, per_row)
        return x

    def tensor_plan(self) -> TensorPlan:
        """Split both attentions by heads and the feed-forward by hidden units."""
        plan = self.attn1.tensor_plan("attn1") | self.attn2.tensor_plan("attn2")
        return plan | {"ffn.net.0.proj": "colwise", "ffn.net.2": "rowwise"}


class WanImageEmbedding(nn.Module):
    """diffusers' ``WanImageEmbedding``: CLIP's states normed, through a GELU MLP, normed.

    A first-last-frame DiT (``pos_embed_seq_len``) reads both images' states as one
    sequence, with learned positions added.
    """

    def __init__(self, width: int, dim: int, positions: int | None) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(width, IMAGE_EPS)
        self.ff = FeedForward(width, 1, out=dim, exact=True)
        self.norm2 = nn.LayerNorm(dim, IMAGE_EPS)
        self.pos_embed = (
            None if positions is None else nn.Parameter(torch.zeros(1, positions, width))
        )

    def forward(self, image: torch.Tensor) -> torch.Tensor:
        """Embed ``(B, P, width)`` states (pairs: ``(2B, P, width)``) as ``(B, P', E)``."""
        if self.pos_embed is not None:
            image = image.reshape(-1, 2 * image.shape[1], image.shape[2]) + self.pos_embed
        out: torch.Tensor = self.norm2(self.ff(self.norm1(image)))
        return out


class WanConditionEmbedder(nn.Module):
    """diffusers' ``WanTimeTextImageEmbedding``: the timestep, the text and the image states."""

    def __init__(self, config: Mapping[str, Any], dim: int) -> None:
        super().__init__()
        self.channels = int(config.get("freq_dim", 256))
        self.time_embedder = TimestepEmbedding(self.channels, dim)
        self.time_proj = nn.Linear(dim, 6 * dim)
        self.text_embedder = TextProjection(int(config["text_dim"]), dim, tanh_gelu=True)
        image = config.get("image_dim")
        positions = config.get("pos_embed_seq_len")
        self.image_embedder = (
            None
            if image is None
            else WanImageEmbedding(int(image), dim, None if positions is None else int(positions))
        )

    def time(self, timestep: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Embed timesteps ``(m,)``: ``temb`` ``(m, E)`` and the six vectors ``(m, 6, E)``."""
        features = timestep_features(timestep, self.channels)
        embedded = self.time_embedder(features.to(self.time_proj.weight.dtype)).to(dtype)
        projected = self.time_proj(silu(embedded))
        return embedded, projected.unflatten(1, (6, -1))


class WanTransformer(PackedTransformer):
    """Wan's DiT: the names, shapes and arithmetic of diffusers' class, requests packed.

    Args:
        config: the folder's ``config.json`` of ``WanTransformer3DModel``.
        sites: the declared ``self`` and ``cross`` sites.
    """

    def __init__(self, config: Mapping[str, Any], sites: tuple[AttentionSite, ...]) -> None:
        super().__init__()
        _, head_dim, dim = attention_dims(config)
        frames, rows, columns = (int(side) for side in config["patch_size"])
        self.patch = (frames, rows, columns)
        channels = int(config["in_channels"])
        out_channels = int(config.get("out_channels") or channels)
        self.eps = float(config.get("eps", EPS))
        self.rope = WanRotaryTables(head_dim, int(config.get("rope_max_seq_len", 1024)))
        self.patch_embedding = nn.Conv3d(channels, dim, self.patch, self.patch)
        self.condition_embedder = WanConditionEmbedder(config, dim)
        self.blocks = nn.ModuleList(
            WanBlock(config, sites) for _ in range(int(config["num_layers"]))
        )
        self.proj_out = nn.Linear(dim, out_channels * self.patch[0] * self.patch[1] * self.patch[2])
        self.scale_shift_table = nn.Parameter(torch.zeros(1, 2, dim))

    def forward(
        self, groups: Sequence[WanInputs], cache: StepCache | None = None
    ) -> list[torch.Tensor]:
        """Predict ``(B_g, C_out, f_g, h_g, w_g)`` for every group, all requests in one
        packed pass."""
        if cache is not None:
            raise ValueError("the Wan DiT runs no step cache")  # the kind refuses one
        tokens = [self.patch_embedding(g.hidden_states).flatten(2).transpose(1, 2) for g in groups]
        videos = [x for group in tokens for x in group]  # (N_i, E) each
        counts = [x.shape[0] for x in videos]
        dtype, device = videos[0].dtype, videos[0].device
        layout = JointLayout([0] * len(videos), counts, device, self.sequence)
        rotation = torch.cat(
            [self.rope.rotation(self._grid(g)).repeat(len(g.timestep), 1, 1) for g in groups]
        )  # (sum N_i, 2, D/2)
        condition = self._conditioning(groups, counts, dtype, layout)
        context = self._context(groups)
        x = layout.local(torch.cat(videos))  # padding rows too
        rotation = layout.local(rotation)
        for block in self.blocks:
            x = block(x, condition, context, rotation, layout)
        table = self.scale_shift_table + condition.embedded[:, None].float()  # (B or n, 2, E)
        shift, scale = table.unbind(1)
        out = self.proj_out(
            modulated(x, layout.joint_rows, shift, scale, condition.per_row, self.eps)
        )
        stacked = regroup(layout.gather(out), counts, [len(g.timestep) for g in groups])
        return [self._unpatchify(s, g) for s, g in zip(stacked, groups, strict=True)]

    def _grid(self, group: WanInputs) -> tuple[int, int, int]:
        """Return a group's grid of patches (frames, rows, columns)."""
        f, h, w = group.hidden_states.shape[-3:]
        pf, ph, pw = self.patch
        return f // pf, h // ph, w // pw

    def _unpatchify(self, tokens: torch.Tensor, group: WanInputs) -> torch.Tensor:
        """Fold ``(B, N, p_f * p_h * p_w * C)`` back into latents ``(B, C, f, h, w)``."""
        f, h, w = self._grid(group)
        pf, ph, pw = self.patch
        grid = tokens.reshape(tokens.shape[0], f, h, w, pf, ph, pw, -1)
        out = grid.permute(0, 7, 1, 4, 2, 5, 3, 6)
        return out.flatten(6, 7).flatten(4, 5).flatten(2, 3)

    def _conditioning(
        self,
        groups: Sequence[WanInputs],
        counts: Sequence[int],
        dtype: torch.dtype,
        layout: JointLayout,
    ) -> Conditioning:
        """Embed every request's timestep; per token (over this rank's rows) only where a
        request's tokens have different timesteps."""
        per_request = []
        for group in groups:
            t = group.timestep
            if t.ndim == 2 and bool((t != t[:, :1]).any()):
                break
            per_request.append(t if t.ndim == 1 else t[:, 0])
        else:
            embedded, projected = self.condition_embedder.time(torch.cat(per_request), dtype)
            return Conditioning(embedded, projected, per_row=False)
        each = [t for group in groups for t in group.timestep]  # (N_i,) or () per request
        timesteps = [t.expand(n) for t, n in zip(each, counts, strict=True)]
        embedded, projected = self.condition_embedder.time(torch.cat(timesteps), dtype)
        return Conditioning(layout.local(embedded), layout.local(projected), per_row=True)

    def _context(
        self, groups: Sequence[WanInputs]
    ) -> tuple[list[torch.Tensor], list[torch.Tensor | None]]:
        """Return each request's embedded text ``(L_i, E)`` and image states ``(P, E)``.

        Raises:
            ValueError: the DiT reads image states and a group has none.
        """
        embedder = self.condition_embedder
        texts = [t for g in groups for t in embedder.text_embedder(g.encoder_hidden_states)]
        if embedder.image_embedder is None:
            return texts, [None] * len(texts)
        images = []
        for group in groups:
            if group.encoder_hidden_states_image is None:
                raise ValueError(
                    "this Wan DiT cross-attends to image states (image_dim): pass "
                    "encoder_hidden_states_image with every group"
                )
            images += list(embedder.image_embedder(group.encoder_hidden_states_image))
        return texts, images

    def parallelize(self, parallel: ComponentParallel) -> None:
        """Split as every packed DiT does; the norms across heads sum over the heads' ranks."""
        super().parallelize(parallel)
        if parallel.tensor is None:
            return
        for module in self.modules():
            if isinstance(module, HeadsRMSNorm):
                module.tensor = parallel.tensor

    def tensor_plans(self, shards: int) -> Iterator[tuple[nn.Module, TensorPlan]]:
        """Yield every block with its split."""
        for block in self.blocks:
            assert isinstance(block, WanBlock)
            yield block, block.tensor_plan()


def unsupported(config: Mapping[str, Any]) -> str | None:
    """Say what of ``config`` this module does not build, or None.

    Image states are attended apart through added projections (Wan 2.1 I2V and FLF2V):
    without them diffusers reads the image states as text, and with them but no image
    embedder it reads the text's first tokens as image states; neither is a released Wan.
    """
    image, added = config.get("image_dim"), config.get("added_kv_proj_dim")
    if (image is None) != (added is None):
        given, missing = ("image_dim", "added_kv_proj_dim")[:: 1 if added is None else -1]
        return f"{given} without {missing} (image states not attended through added projections)"
    return None
