"""``tiny_text_encoder``: a pre-norm transformer encoder, token ids to embeddings.

The custom path attends through ``attention.Attention`` (site ``self``, with a key
padding mask); the native path is the same network on ``nn.TransformerEncoderLayer``.
Both name their tensors alike, so one seed or file gives both the same weights.
"""

from __future__ import annotations

import re
import zlib
from itertools import islice
from typing import Annotated, ClassVar, NamedTuple

import msgspec
import torch
from torch import nn
from torch.nn.functional import gelu

from attention import AttentionRequirements, AttentionRole
from components.batch import Batch, Port, device_of
from components.kinds import tensors
from components.kinds.projections import MultiheadProjections
from components.loader import ComponentLoader, SeededOptions
from components.sites import AttentionSite
from components.weights import DeclaredTensors

__all__ = ["DEFAULT_DIM", "TinyTextEncoderLoader"]

# B batch, H heads, S seq, D head dim, E model width (dim)

_WORD = re.compile(r"\S+")
"""A word: what ``str.split()`` separates (regex whitespace is ``str.isspace``)."""

DEFAULT_DIM = 32
"""The default width; ``tiny_dit``'s ``context_dim`` defaults to it."""


class TinyTextEncoderOptions(SeededOptions, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Options of ``tiny_text_encoder``.

    Attributes:
        vocab_size: token ids run from 0 to ``vocab_size - 1``.
        max_len: the longest sequence (learned positions).
        dim: the model width E; a multiple of ``heads``.
        heads: attention heads per layer.
        layers: encoder layers.
        ffn_dim: the hidden width of each layer's MLP.

    Raises:
        ValueError: ``heads`` does not divide ``dim`` (a ``msgspec.ValidationError`` when
            the options are decoded).
    """

    vocab_size: Annotated[int, msgspec.Meta(ge=2)] = 512
    max_len: Annotated[int, msgspec.Meta(ge=1)] = 32
    dim: Annotated[int, msgspec.Meta(ge=1)] = DEFAULT_DIM
    heads: Annotated[int, msgspec.Meta(ge=1)] = 4
    layers: Annotated[int, msgspec.Meta(ge=1)] = 2
    ffn_dim: Annotated[int, msgspec.Meta(ge=1)] = 64

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.dim % self.heads:
            raise ValueError(
                f"heads = {self.heads} must divide dim = {self.dim}; change one of them"
            )


class TextEncoderInputs(NamedTuple):
    """The arguments of ``TinyTextEncoder.forward``."""

    tokens: torch.Tensor  # (B, S) int64
    mask: torch.Tensor  # (B, S) bool, True = real token


class EncoderSelfAttention(MultiheadProjections):
    """Self-attention under a key padding mask, named like ``nn.MultiheadAttention``.

    Args:
        dim: the model width E.
        site: the declared site; its heads and layer come from it.
    """

    def __init__(self, dim: int, site: AttentionSite) -> None:
        super().__init__(dim, site.heads)
        self.attn = site.build_layer()

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Attend each token to the real tokens of its row: ``(B, S, E)`` to ``(B, S, E)``."""
        q, k, v = (t.transpose(1, 2) for t in self.project_qkv(x))  # (B, H, S, D)
        keep = mask[:, None, None, :]  # (B, 1, 1, S): every query sees the real keys
        o = self.attn(q, k, v, attn_mask=keep)  # (B, H, S, D)
        return self.project_out(o.transpose(1, 2))  # (B, S, E)


class EncoderLayer(nn.Module):
    """One pre-norm encoder layer, named like ``nn.TransformerEncoderLayer``.

    Args:
        dim: the model width E.
        ffn_dim: the MLP's hidden width.
        site: the declared self-attention site.
    """

    def __init__(self, dim: int, ffn_dim: int, site: AttentionSite) -> None:
        super().__init__()
        self.self_attn = EncoderSelfAttention(dim, site)
        self.linear1 = nn.Linear(dim, ffn_dim)
        self.linear2 = nn.Linear(ffn_dim, dim)
        self.norm1 = nn.LayerNorm(dim)
        self.norm2 = nn.LayerNorm(dim)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Run attention then the MLP, each on a normalised residual: ``(B, S, E)``."""
        x = x + self.self_attn(self.norm1(x), mask)
        mlp: torch.Tensor = self.linear2(gelu(self.linear1(self.norm2(x))))
        return x + mlp  # (B, S, E)


class TinyTextEncoder(nn.Module):
    """Encode token ids into one embedding per token.

    Args:
        options: the kind's options.
        layers: the encoder layers, custom ``EncoderLayer`` or native
            ``nn.TransformerEncoderLayer``; which one is fixed here, once.
    """

    def __init__(self, options: TinyTextEncoderOptions, layers: list[nn.Module]) -> None:
        super().__init__()
        self.tok_emb = nn.Embedding(options.vocab_size, options.dim)
        self.pos_emb = nn.Embedding(options.max_len, options.dim)
        self.layers = nn.ModuleList(layers)
        self.norm = nn.LayerNorm(options.dim)
        self.is_native = all(isinstance(layer, nn.TransformerEncoderLayer) for layer in layers)

    def forward(self, tokens: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Embed ``tokens`` ``(B, S)`` int64 under ``mask`` ``(B, S)`` bool (True = real).

        Returns ``(B, S, E)``; rows of padding positions are computed but meaningless.
        """
        positions = torch.arange(tokens.shape[1], device=tokens.device)  # (S,)
        x = self.tok_emb(tokens) + self.pos_emb(positions)  # (B, S, E)
        # TransformerEncoderLayer's key padding mask says True = ignore
        padding = ~mask  # (B, S)
        for layer in self.layers:
            x = layer(x, src_key_padding_mask=padding) if self.is_native else layer(x, mask)
        out: torch.Tensor = self.norm(x)  # (B, S, E)
        return out


class TinyTextEncoderLoader(ComponentLoader):
    """Build ``tiny_text_encoder``; an auxiliary component, so global fallback is allowed."""

    kind: ClassVar[str] = "tiny_text_encoder"
    fully_shardable = True
    options_type = TinyTextEncoderOptions
    allows_global_fallback = True
    block_stack = "layers"

    def __init__(self, options: TinyTextEncoderOptions) -> None:
        super().__init__(options)
        self.options: TinyTextEncoderOptions = options

    def sites(self) -> tuple[AttentionSite, ...]:
        """Declare the one self-attention site; it needs a mask for padding."""
        return (
            AttentionSite(
                name="self",
                role=AttentionRole.SELF,
                heads=self.options.heads,
                requirements=AttentionRequirements(attention_mask=True),
                supported=frozenset({"torch_sdpa", "torch_flash", "reference", "flash_attn"}),
            ),
        )

    def block_count(self) -> int:
        """Return the number of blocks layerwise offload streams."""
        return self.options.layers

    def tensors(self) -> DeclaredTensors:
        """Declare embeddings, layers (as ``nn.TransformerEncoderLayer`` names them), norm."""
        o = self.options
        declared = {
            **tensors.embedding("tok_emb", o.vocab_size, o.dim),
            **tensors.embedding("pos_emb", o.max_len, o.dim),
            **tensors.norm("norm", o.dim),
        }
        for i in range(o.layers):
            at = f"layers.{i}"
            declared |= {
                **tensors.attention_projections(f"{at}.self_attn", o.dim, o.dim),
                **tensors.linear(f"{at}.linear1", o.dim, o.ffn_dim),
                **tensors.linear(f"{at}.linear2", o.ffn_dim, o.dim),
                **tensors.norm(f"{at}.norm1", o.dim),
                **tensors.norm(f"{at}.norm2", o.dim),
            }
        return declared

    def writes(self) -> tuple[Port, ...]:
        """Write the context, ``dim`` wide."""
        return (Port(field="context", width=self.options.dim, option="dim"),)

    def run(self, module: nn.Module, batch: Batch) -> None:
        """Encode the request's prompts (seeded tokens when it has none), and its negative ones.

        The context is each prompt's real tokens only.
        """
        if batch.prompts is None:
            inputs = example_inputs(self.options, batch.size, batch.generator)
        else:
            found = prompt_inputs(self.options, batch.prompts)
            inputs = TextEncoderInputs(found.tokens, found.mask)
            batch.mark_truncated(list(found.truncated))
        batch.context = _encode(module, *inputs)
        if batch.negative_prompts is not None:
            negative = prompt_inputs(self.options, batch.negative_prompts)
            batch.negative_context = _encode(module, negative.tokens, negative.mask)

    def build_custom(self) -> TinyTextEncoder:
        """Build the encoder on ``attention.Attention`` layers of site ``self``."""
        (site,) = self.sites()
        layers: list[nn.Module] = [
            EncoderLayer(self.options.dim, self.options.ffn_dim, site)
            for _ in range(self.options.layers)
        ]
        return TinyTextEncoder(self.options, layers)

    def build_native(self) -> TinyTextEncoder:
        """Build the same network on ``nn.TransformerEncoderLayer`` (no attention package)."""
        opts = self.options
        layers: list[nn.Module] = [
            nn.TransformerEncoderLayer(
                opts.dim,
                opts.heads,
                dim_feedforward=opts.ffn_dim,
                dropout=0.0,
                activation="gelu",
                batch_first=True,
                norm_first=True,
            )
            for _ in range(opts.layers)
        ]
        return TinyTextEncoder(opts, layers)


class PromptTokens(NamedTuple):
    """Prompts tokenised by words, padded to the longest."""

    tokens: torch.Tensor  # (B, S) int64
    mask: torch.Tensor  # (B, S) bool, True = real token
    truncated: tuple[bool, ...]  # (B,) whether each prompt had words past max_len


def prompt_inputs(options: TinyTextEncoderOptions, prompts: list[str]) -> PromptTokens:
    """Tokenise ``prompts`` by words: a word's id is its CRC-32 modulo ``vocab_size``.

    A toy tokenizer (the kind has no vocabulary file) that makes the text matter: the
    same prompt always gives the same tokens, whatever else is in the batch. Words past
    ``max_len`` are dropped, and never read: a prompt of megabytes costs what one of
    ``max_len`` words does. An empty prompt is one padding token.
    """
    rows: list[list[int]] = []
    truncated: list[bool] = []
    for text in prompts:
        words = [m.group().lower() for m in islice(_WORD.finditer(text), options.max_len + 1)]
        truncated.append(len(words) > options.max_len)
        rows.append([zlib.crc32(w.encode()) % options.vocab_size for w in words][: options.max_len])
    rows = [row or [0] for row in rows]
    width = max((len(row) for row in rows), default=1)
    tokens = torch.zeros(len(rows), width, dtype=torch.int64)  # (B, S)
    mask = torch.zeros(len(rows), width, dtype=torch.bool)  # (B, S)
    for i, row in enumerate(rows):
        tokens[i, : len(row)] = torch.tensor(row)
        mask[i, : len(row)] = True
    return PromptTokens(tokens, mask, tuple(truncated))


def example_inputs(
    options: TinyTextEncoderOptions, batch: int, generator: torch.Generator, seq_len: int = 8
) -> TextEncoderInputs:
    """Make ``batch`` seeded rows of ``seq_len`` tokens with padding of different lengths.

    Row ``i`` has ``seq_len - i % (seq_len // 2 + 1)`` real tokens (at least one); padding
    positions hold token 0.
    """
    seq_len = min(seq_len, options.max_len)
    tokens = torch.randint(0, options.vocab_size, (batch, seq_len), generator=generator)
    lengths = torch.tensor([max(seq_len - i % (seq_len // 2 + 1), 1) for i in range(batch)])
    mask = torch.arange(seq_len)[None, :] < lengths[:, None]  # (B, S)
    return TextEncoderInputs(tokens.masked_fill(~mask, 0), mask)


def _encode(module: nn.Module, tokens: torch.Tensor, mask: torch.Tensor) -> list[torch.Tensor]:
    """Return each sequence's embeddings on its real tokens only: ``(L_i, E)`` each."""
    device = device_of(module)
    tokens, mask = tokens.to(device), mask.to(device)  # (B, S) each
    embeddings = module(tokens, mask)  # (B, S, E)
    return [embeddings[i][mask[i]] for i in range(len(mask))]
