"""T5's encoder (transformers' ``T5EncoderModel``) on ``attention.Attention``.

Each block attends with a learned relative position bias added to the scores (no
1/sqrt(D) scaling), computed once by the first block and shared by the rest; padding
is folded into the same bias. Tensor parallel splits the heads (q, k, v, the bias
table) and the feed-forward units over the ``tp`` ranks with DTensor.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from typing import Any, NamedTuple

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.nn.functional import gelu, relu

from components.sites import AttentionSite, SiteLayer
from components.tensor_parallel import split_layers

__all__ = ["ACTIVATIONS", "T5Encoder", "T5Shape"]

# B batch, H heads, S seq, D head dim (d_kv), E width (d_model), F feed-forward width

ACTIVATIONS = ("gelu_new", "gelu", "relu")
"""The feed-forward activations this module implements (``dense_act_fn``)."""


class T5Shape(NamedTuple):
    """The sizes of a T5 encoder, read from its ``config.json``."""

    vocab: int
    width: int  # E
    head_dim: int  # D
    heads: int  # H
    layers: int
    ff_width: int  # F
    gated: bool  # two input projections (wi_0 activated, times wi_1)
    activation: str
    eps: float
    buckets: int
    max_distance: int

    @classmethod
    def of(cls, config: Mapping[str, Any]) -> T5Shape:
        """Read the sizes as ``T5Config`` derives them (``feed_forward_proj``: "gated-gelu")."""
        proj = str(config.get("feed_forward_proj", "relu")).split("-")
        gated = len(proj) > 1 and proj[0] == "gated"
        activation = "gelu_new" if proj == ["gated", "gelu"] else proj[-1]
        return cls(
            vocab=int(config["vocab_size"]),
            width=int(config["d_model"]),
            head_dim=int(config["d_kv"]),
            heads=int(config["num_heads"]),
            layers=int(config["num_layers"]),
            ff_width=int(config["d_ff"]),
            gated=gated,
            activation=activation,
            eps=float(config.get("layer_norm_epsilon", 1e-6)),
            buckets=int(config.get("relative_attention_num_buckets", 32)),
            max_distance=int(config.get("relative_attention_max_distance", 128)),
        )


class RmsNorm(nn.Module):
    """T5's layer norm: scale by the root mean square (taken in float32), no mean, no bias."""

    def __init__(self, width: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Normalise ``(..., E)``; the result takes the weight's dtype when it is half."""
        variance = x.to(torch.float32).pow(2).mean(-1, keepdim=True)
        x = x * torch.rsqrt(variance + self.eps)
        if self.weight.dtype in (torch.float16, torch.bfloat16):
            x = x.to(self.weight.dtype)
        out: torch.Tensor = self.weight * x
        return out


@functools.lru_cache(maxsize=8)
def relative_buckets(length: int, buckets: int, max_distance: int) -> torch.Tensor:
    """Return the ``(S, S)`` bucket of each key's position relative to each query's.

    Bidirectional: half the buckets for keys after the query. Within each half, exact
    distances below a quarter of the buckets, then logarithmic bins up to
    ``max_distance``, beyond which all distances share the last bucket.

    One CPU tensor per arguments, shared by every encode (callers only read it): at 512
    tokens it took 7 ms of each, and it depends on nothing but these three numbers. Made
    outside inference mode, so a forward with gradients may still index with it.
    """
    with torch.inference_mode(False):
        position = torch.arange(length, dtype=torch.long, device="cpu")
        relative = position[None, :] - position[:, None]  # key - query, (S, S)
        half = buckets // 2
        bucket = (relative > 0).to(torch.long) * half
        distance = relative.abs()
        exact = half // 2
        far = exact + (
            torch.log(distance.float() / exact) / math.log(max_distance / exact) * (half - exact)
        ).to(torch.long)
        far = torch.clamp(far, max=half - 1)
        return bucket + torch.where(distance < exact, distance, far)


class T5Attention(nn.Module):
    """Self-attention with a relative position bias; only the first block owns the table.

    Args:
        shape: the encoder's sizes.
        owns_bias: build the ``relative_attention_bias`` table (the first block).
        site: the declared ``self`` site (its layer is built at load, ``build_layers``).
    """

    def __init__(self, shape: T5Shape, owns_bias: bool, site: AttentionSite) -> None:
        super().__init__()
        inner = shape.heads * shape.head_dim
        self.q = nn.Linear(shape.width, inner, bias=False)
        self.k = nn.Linear(shape.width, inner, bias=False)
        self.v = nn.Linear(shape.width, inner, bias=False)
        self.o = nn.Linear(inner, shape.width, bias=False)
        if owns_bias:
            self.relative_attention_bias = nn.Embedding(shape.buckets, shape.heads)
        self.shape = shape
        self.attn = SiteLayer(site, scale=1.0)

    def position_bias(self, length: int) -> torch.Tensor:
        """Return the learned bias ``(1, H, S, S)`` (this rank's heads under tensor parallel)."""
        table: nn.Embedding = self.relative_attention_bias
        buckets = relative_buckets(length, self.shape.buckets, self.shape.max_distance)
        values: torch.Tensor = table(buckets.to(table.weight.device))  # (S, S, H)
        return values.permute(2, 0, 1).unsqueeze(0)  # (1, H, S, S)

    def forward(self, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        """Attend ``x`` ``(B, S, E)`` to itself with ``bias`` ``(B or 1, H, S, S)``."""
        b, s, _ = x.shape
        d = self.shape.head_dim
        q, k, v = (p(x).view(b, s, -1, d).transpose(1, 2) for p in (self.q, self.k, self.v))
        o = self.attn.layer(q, k, v, bias=bias)  # (B, H, S, D)
        out: torch.Tensor = self.o(o.transpose(1, 2).reshape(b, s, -1))
        return out


class T5LayerSelfAttention(nn.Module):
    """Pre-norm self-attention with a residual (``layer.0`` of a block)."""

    def __init__(self, shape: T5Shape, owns_bias: bool, site: AttentionSite) -> None:
        super().__init__()
        self.SelfAttention = T5Attention(shape, owns_bias, site)
        self.layer_norm = RmsNorm(shape.width, shape.eps)

    def forward(self, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        """Return ``x + attention(norm(x))``, ``(B, S, E)``."""
        out: torch.Tensor = x + self.SelfAttention(self.layer_norm(x), bias)
        return out


class T5FeedForward(nn.Module):
    """The feed-forward, gated (``wi_0``, ``wi_1``) or not (``wi``), then ``wo``.

    ``wo``'s input takes ``wo``'s dtype, which loading may keep in float32 under float16.
    """

    def __init__(self, shape: T5Shape) -> None:
        super().__init__()
        if shape.gated:
            self.wi_0 = nn.Linear(shape.width, shape.ff_width, bias=False)
            self.wi_1 = nn.Linear(shape.width, shape.ff_width, bias=False)
        else:
            self.wi = nn.Linear(shape.width, shape.ff_width, bias=False)
        self.wo = nn.Linear(shape.ff_width, shape.width, bias=False)
        self.gated = shape.gated
        self.activation = shape.activation

    def act(self, x: torch.Tensor) -> torch.Tensor:
        """Apply the configured activation (``gelu_new`` is the tanh approximation)."""
        if self.activation == "relu":
            return relu(x)
        return gelu(x, approximate="tanh" if self.activation == "gelu_new" else "none")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Map ``(B, S, E)`` through ``F`` units back to ``(B, S, E)``."""
        h = self.act(self.wi_0(x)) * self.wi_1(x) if self.gated else self.act(self.wi(x))
        out: torch.Tensor = self.wo(h.to(self.wo.weight.dtype))
        return out


class T5LayerFF(nn.Module):
    """Pre-norm feed-forward with a residual (``layer.1`` of a block)."""

    def __init__(self, shape: T5Shape) -> None:
        super().__init__()
        self.DenseReluDense = T5FeedForward(shape)
        self.layer_norm = RmsNorm(shape.width, shape.eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Return ``x + ff(norm(x))``, ``(B, S, E)``."""
        out: torch.Tensor = x + self.DenseReluDense(self.layer_norm(x))
        return out


def clamp_half(x: torch.Tensor) -> torch.Tensor:
    """Keep float16 states finite as T5 does (its activations overflow float16)."""
    if x.dtype != torch.float16:
        return x
    top = torch.finfo(torch.float16).max
    limit = torch.where(torch.isinf(x).any(), top - 1000, top)
    return torch.clamp(x, min=-limit, max=limit)


class T5Block(nn.Module):
    """One encoder block; the first computes the position bias every block adds.

    Args:
        shape: the encoder's sizes.
        first: this is block 0 (it owns the bias table).
        site: the declared ``self`` site.
    """

    def __init__(self, shape: T5Shape, first: bool, site: AttentionSite) -> None:
        super().__init__()
        self.layer = nn.ModuleList([T5LayerSelfAttention(shape, first, site), T5LayerFF(shape)])
        self.first = first

    @property
    def attention(self) -> T5LayerSelfAttention:
        """The self-attention sublayer (``layer.0``)."""
        found = self.layer[0]
        assert isinstance(found, T5LayerSelfAttention)
        return found

    @property
    def feed_forward(self) -> T5LayerFF:
        """The feed-forward sublayer (``layer.1``)."""
        found = self.layer[1]
        assert isinstance(found, T5LayerFF)
        return found

    def forward(
        self, x: torch.Tensor, bias: torch.Tensor | None, keep: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Update ``x`` ``(B, S, E)``; return it and the bias for the next block.

        The first block builds the bias (``bias`` None) from its table and folds the
        padding of ``keep`` ``(B, S)`` (1 = real token) into it; the table's weights are
        read inside this block's forward, where layerwise offload has them on the device.
        """
        if bias is None:
            bias = self.attention.SelfAttention.position_bias(x.shape[1])  # (1, H, S, S)
            if keep is not None:
                hidden = (keep == 0)[:, None, None, :]  # (B, 1, 1, S)
                bias = bias.masked_fill(hidden, torch.finfo(bias.dtype).min)  # (B, H, S, S)
        x = clamp_half(self.attention(x, bias))
        return clamp_half(self.feed_forward(x)), bias


class T5Stack(nn.Module):
    """The encoder stack: embedding (tied to ``shared``), blocks, final norm."""

    def __init__(self, shape: T5Shape, shared: nn.Embedding, site: AttentionSite) -> None:
        super().__init__()
        self.embed_tokens = shared
        self.block = nn.ModuleList([T5Block(shape, i == 0, site) for i in range(shape.layers)])
        self.final_layer_norm = RmsNorm(shape.width, shape.eps)


class T5Encoder(nn.Module):
    """Encode token ids into T5's last normalised states, as ``T5EncoderModel`` does.

    Args:
        shape: the encoder's sizes.
        site: the declared ``self`` site.
    """

    def __init__(self, shape: T5Shape, site: AttentionSite) -> None:
        super().__init__()
        self.shared = nn.Embedding(shape.vocab, shape.width)
        self.encoder = T5Stack(shape, self.shared, site)

    def forward(self, ids: torch.Tensor, keep: torch.Tensor | None = None) -> torch.Tensor:
        """Return the states ``(B, S, E)`` of ids ``(B, S)``; ``keep`` ``(B, S)`` masks padding
        (1 = real token; None: every token attends to every other)."""
        x = self.encoder.embed_tokens(ids)
        bias: torch.Tensor | None = None
        for block in self.encoder.block:
            x, bias = block(x, bias, keep)
        out: torch.Tensor = self.encoder.final_layer_norm(x)
        return out

    def parallelize(self, mesh: DeviceMesh) -> None:
        """Split every block's heads and feed-forward units over the 1-D ``tp`` mesh.

        q, k, v, the bias table (by heads) and the feed-forward input projections go
        column-wise; ``o`` and ``wo`` row-wise (DTensor all-reduces their partial sums).
        Embeddings and norms stay whole. The heads must divide by the degree (admission
        refuses otherwise); the feed-forward units need not.
        """
        # imported here: torch.distributed.tensor costs ~0.6 CPU-s, which only a process
        # whose layout splits T5 should pay
        from torch.distributed.tensor.parallel import (
            ColwiseParallel,
            ParallelStyle,
            RowwiseParallel,
        )

        for block in self.encoder.block:
            assert isinstance(block, T5Block)
            plan: dict[str, ParallelStyle] = {
                f"layer.0.SelfAttention.{p}": ColwiseParallel() for p in "qkv"
            }
            plan["layer.0.SelfAttention.o"] = RowwiseParallel()
            if block.first:
                plan["layer.0.SelfAttention.relative_attention_bias"] = ColwiseParallel()
            ff = block.feed_forward.DenseReluDense
            for name in ("wi_0", "wi_1") if ff.gated else ("wi",):
                # kept as DTensors, so that d_ff need not divide by the tp degree: a
                # local shard would not say how many units the other ranks hold
                plan[f"layer.1.DenseReluDense.{name}"] = ColwiseParallel(use_local_output=False)
            plan["layer.1.DenseReluDense.wo"] = RowwiseParallel()
            split_layers(block, mesh, plan)
