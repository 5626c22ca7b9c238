"""CLIP's text model (transformers' ``CLIPTextModel``, ``CLIPTextModelWithProjection``) on
``attention.Attention``.

The attention is causal and runs through the kernel's causal mode, dense or packed
(``forward_varlen(is_causal=True)`` over prompts of different lengths back to back):
nothing here builds a sequence-by-sequence mask. The pooled output is the final state
of each prompt's end token, projected where the class has a projection.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from typing import Any, NamedTuple

import torch
from torch import nn
from torch.nn.functional import gelu, pad

from components.sites import AttentionSite, SiteLayer

__all__ = ["ACTIVATIONS", "ClipShape", "ClipStates", "ClipTextModel", "ClipTextTransformer"]

# B prompts, H heads, S tokens, D head dim, E width, F feed-forward width, P pooled width,
# T packed tokens (sum of S_i)

ACTIVATIONS = ("quick_gelu", "gelu", "gelu_new", "gelu_pytorch_tanh")
"""The feed-forward activations this module implements (``hidden_act``)."""
OLD_EOS_ID = 2
"""Configs written before transformers fixed ``eos_token_id`` say 2: the end token is then
the highest id of each prompt, as transformers still reads it."""


class ClipShape(NamedTuple):
    """The sizes of a CLIP text model, read from its ``config.json``."""

    vocab: int
    width: int  # E
    heads: int  # H
    layers: int
    ff_width: int  # F
    activation: str
    eps: float
    positions: int
    eos_id: int

    @classmethod
    def of(cls, config: Mapping[str, Any]) -> ClipShape:
        """Read the sizes (``CLIPTextConfig``'s keys and defaults)."""
        return cls(
            vocab=int(config["vocab_size"]),
            width=int(config["hidden_size"]),
            heads=int(config["num_attention_heads"]),
            layers=int(config["num_hidden_layers"]),
            ff_width=int(config["intermediate_size"]),
            activation=str(config.get("hidden_act", "quick_gelu")),
            eps=float(config.get("layer_norm_eps", 1e-5)),
            positions=int(config.get("max_position_embeddings", 77)),
            eos_id=int(config.get("eos_token_id", OLD_EOS_ID)),
        )


class Packing(NamedTuple):
    """Prompts of different lengths packed back to back: ``(T, ...)`` rows."""

    cu_seqlens: torch.Tensor  # (B + 1,) int32 boundaries
    max_seqlen: int

    @property
    def lengths(self) -> list[int]:
        """The tokens of each prompt."""
        bounds = self.cu_seqlens.tolist()
        return [b - a for a, b in itertools.pairwise(bounds)]


class ClipStates(NamedTuple):
    """What the text model hands on: the pooled output and the penultimate layer's states."""

    pooled: torch.Tensor  # (B, E), or (B, P) projected
    penultimate: torch.Tensor  # (B, S, E), or (T, E) packed: the states the last layer reads


class ClipEmbeddings(nn.Module):
    """Token plus learned position embeddings, with ``position_ids`` as transformers keeps them."""

    position_ids: torch.Tensor  # (1, positions), a buffer the files do not store

    def __init__(self, shape: ClipShape) -> None:
        super().__init__()
        self.token_embedding = nn.Embedding(shape.vocab, shape.width)
        self.position_embedding = nn.Embedding(shape.positions, shape.width)
        positions = torch.arange(shape.positions).expand((1, -1))
        self.register_buffer("position_ids", positions, persistent=False)

    def forward(self, ids: torch.Tensor, packing: Packing | None) -> torch.Tensor:
        """Embed ids ``(B, S)`` (or packed ``(T,)``); positions restart at each prompt.

        Raises:
            ValueError: a prompt is longer than the position table.
        """
        length = ids.shape[-1] if packing is None else packing.max_seqlen
        if length > self.position_embedding.num_embeddings:
            raise ValueError(
                f"a prompt of {length} tokens is longer than CLIP's "
                f"{self.position_embedding.num_embeddings} positions; truncate it"
            )
        if packing is None:
            positions = self.position_ids[:, : ids.shape[-1]]  # (1, S)
        else:
            starts = packing.cu_seqlens[:-1].to(torch.long)
            lengths = torch.tensor(packing.lengths, device=ids.device)
            positions = torch.arange(ids.shape[0], device=ids.device) - starts.repeat_interleave(
                lengths
            )  # (T,)
        out: torch.Tensor = self.token_embedding(ids) + self.position_embedding(positions)
        return out


class ClipAttention(nn.Module):
    """Causal self-attention with biased q, k, v and output projections.

    Args:
        shape: the model's sizes.
        site: the declared ``self`` site.
    """

    def __init__(self, shape: ClipShape, site: AttentionSite) -> None:
        super().__init__()
        self.k_proj = nn.Linear(shape.width, shape.width)
        self.v_proj = nn.Linear(shape.width, shape.width)
        self.q_proj = nn.Linear(shape.width, shape.width)
        self.out_proj = nn.Linear(shape.width, shape.width)
        self.head_dim = shape.width // shape.heads
        self.attn = SiteLayer(site)

    def forward(self, x: torch.Tensor, packing: Packing | None) -> torch.Tensor:
        """Attend ``x`` ``(B, S, E)`` causally, or packed ``(T, E)`` prompt by prompt."""
        d = self.head_dim
        layer = self.attn.layer
        q, k, v = (p(x).unflatten(-1, (-1, d)) for p in (self.q_proj, self.k_proj, self.v_proj))
        if packing is not None:  # (T, H, D)
            o = layer.forward_varlen(
                q,
                k,
                v,
                packing.cu_seqlens,
                packing.cu_seqlens,
                packing.max_seqlen,
                packing.max_seqlen,
                is_causal=True,
            )  # (T, H, D)
        else:  # (B, S, H, D)
            o = layer(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
            o = o.transpose(1, 2)  # (B, S, H, D)
        out: torch.Tensor = self.out_proj(o.flatten(-2))
        return out


class ClipMlp(nn.Module):
    """``fc1``, the activation, ``fc2``."""

    def __init__(self, shape: ClipShape) -> None:
        super().__init__()
        self.fc1 = nn.Linear(shape.width, shape.ff_width)
        self.fc2 = nn.Linear(shape.ff_width, shape.width)
        self.activation = shape.activation

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Map ``(..., E)`` through ``F`` units back to ``(..., E)``."""
        h = self.fc1(x)
        if self.activation == "quick_gelu":
            h = h * torch.sigmoid(1.702 * h)
        else:
            h = gelu(h, approximate="none" if self.activation == "gelu" else "tanh")
        out: torch.Tensor = self.fc2(h)
        return out


class ClipLayer(nn.Module):
    """Pre-norm causal attention and MLP, each with a residual."""

    def __init__(self, shape: ClipShape, site: AttentionSite) -> None:
        super().__init__()
        self.self_attn = ClipAttention(shape, site)
        self.layer_norm1 = nn.LayerNorm(shape.width, eps=shape.eps)
        self.mlp = ClipMlp(shape)
        self.layer_norm2 = nn.LayerNorm(shape.width, eps=shape.eps)

    def forward(self, x: torch.Tensor, packing: Packing | None) -> torch.Tensor:
        """Update ``(B, S, E)`` or packed ``(T, E)`` states."""
        x = x + self.self_attn(self.layer_norm1(x), packing)
        out: torch.Tensor = x + self.mlp(self.layer_norm2(x))
        return out


class ClipEncoder(nn.Module):
    """The layer stack (``encoder.layers``)."""

    def __init__(self, shape: ClipShape, site: AttentionSite) -> None:
        super().__init__()
        self.layers = nn.ModuleList([ClipLayer(shape, site) for _ in range(shape.layers)])


class ClipTextTransformer(nn.Module):
    """The text tower: embeddings, causal layers, final norm, pooled end token.

    Args:
        shape: the model's sizes.
        site: the declared ``self`` site.
    """

    def __init__(self, shape: ClipShape, site: AttentionSite) -> None:
        super().__init__()
        self.embeddings = ClipEmbeddings(shape)
        self.encoder = ClipEncoder(shape, site)
        self.final_layer_norm = nn.LayerNorm(shape.width, eps=shape.eps)
        self.eos_id = shape.eos_id

    def forward(self, ids: torch.Tensor, cu_seqlens: torch.Tensor | None = None) -> ClipStates:
        """Encode ids ``(B, S)``, or packed ids ``(T,)`` with boundaries ``(B + 1,)``.

        Returns the final normalised state of each prompt's end token ``(B, E)`` and the
        states the last layer reads, in the layout of ``ids``.
        """
        packing = None
        if cu_seqlens is not None:
            lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).tolist()
            packing = Packing(cu_seqlens.to(torch.int32), max(lengths))
        x = self.embeddings(ids, packing)
        penultimate = x
        for layer in self.encoder.layers:
            penultimate = x
            x = layer(x, packing)
        rows = self.end_rows(ids, packing)  # (B,) flat row of each end token
        last = self.final_layer_norm(x.reshape(-1, x.shape[-1])[rows])  # (B, E)
        return ClipStates(last, penultimate)

    def end_rows(self, ids: torch.Tensor, packing: Packing | None) -> torch.Tensor:
        """Return the flat row of each prompt's end token: its first ``eos_token_id`` (or,
        for configs from before transformers fixed it, its highest id)."""
        if packing is None:
            found = (
                ids.argmax(-1)
                if self.eos_id == OLD_EOS_ID
                else (ids == self.eos_id).int().argmax(-1)
            )
            return found + torch.arange(ids.shape[0], device=ids.device) * ids.shape[-1]
        starts = packing.cu_seqlens[:-1].to(torch.long)
        prompts = pad(ids, (0, packing.max_seqlen)).unfold(0, packing.max_seqlen, 1)[starts]
        lengths = torch.tensor(packing.lengths, device=ids.device)
        inside = torch.arange(packing.max_seqlen, device=ids.device)[None, :] < lengths[:, None]
        if self.eos_id == OLD_EOS_ID:
            found = prompts.masked_fill(~inside, -1).argmax(-1)
        else:
            found = ((prompts == self.eos_id) & inside).int().argmax(-1)
        return starts + found


class ClipTextModel(nn.Module):
    """The tower under ``text_model``, with ``text_projection`` where the class has it.

    Args:
        shape: the model's sizes.
        projection: the projected pooled width, or None (a ``CLIPTextModel`` stored with
            the ``text_model.`` prefix).
        site: the declared ``self`` site.
    """

    def __init__(self, shape: ClipShape, projection: int | None, site: AttentionSite) -> None:
        super().__init__()
        self.text_model = ClipTextTransformer(shape, site)
        self.text_projection = (
            None if projection is None else nn.Linear(shape.width, projection, bias=False)
        )

    def forward(self, ids: torch.Tensor, cu_seqlens: torch.Tensor | None = None) -> ClipStates:
        """Encode as the tower does; project the pooled output where there is a projection."""
        states: ClipStates = self.text_model(ids, cu_seqlens)
        if self.text_projection is None:
            return states
        return ClipStates(self.text_projection(states.pooled), states.penultimate)
