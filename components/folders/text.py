"""Text encoders of a folder: each owns its tokenizer, read from the folder's tokenizer files.

A pipeline folder pairs ``text_encoder_N`` with ``tokenizer_N``; the tokenizer is built
by the transformers class ``model_index.json`` names (as diffusers builds it), from the
files alone: nothing is downloaded and no code from the folder runs.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Sequence
from functools import cached_property
from pathlib import Path
from typing import Any, ClassVar, NamedTuple

import torch

from components.folders.loader import FolderLoader, FolderOptions
from components.libraries import library_class
from components.loader import LoaderPath

__all__ = ["TextEncoderLoader", "TextEncoderOptions", "Tokens"]

# B texts, L tokens

TOKENIZER_CONFIG = "tokenizer_config.json"


class TextEncoderOptions(FolderOptions, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Options of a folder's text encoder.

    Attributes:
        tokenizer: the folder of its tokenizer's files.
        tokenizer_class: the transformers tokenizer class (``model_index.json`` names
            it); None takes the one ``tokenizer_config.json`` names.
    """

    files: ClassVar[tuple[str, ...]] = ("weights", "path", "tokenizer")

    tokenizer: str | None = None
    tokenizer_class: str | None = None


class Tokens(NamedTuple):
    """Token ids of a batch of texts, padded to a fixed length."""

    ids: torch.Tensor  # (B, L) int64
    mask: torch.Tensor  # (B, L) int64, 1 = real token


class TextEncoderLoader(FolderLoader):
    """A folder component that encodes text, with the tokenizer it owns."""

    options_type = TextEncoderOptions
    allows_global_fallback = True  # an auxiliary component (design §4.2)

    def __init__(self, options: TextEncoderOptions) -> None:
        super().__init__(options)
        self.options: TextEncoderOptions = options
        # A fast tokenizer keeps its padding and truncation settings in the Rust object
        # and sets them on every call: two calls with different lengths at once (requests
        # of a worker's threads) would take each other's, and return other shapes.
        self._calls = threading.Lock()

    def unavailable_reason(self, path: LoaderPath) -> str | None:
        """Say why ``path`` cannot build this component here; a missing tokenizer counts."""
        reason = super().unavailable_reason(path)
        if reason is None and self.options.tokenizer is not None:
            folder = Path(self.options.tokenizer)
            if not folder.is_dir():
                return f"its tokenizer folder '{folder}' does not exist"
        return reason

    @cached_property
    def tokenizer(self) -> Any:
        """The tokenizer, built on first use by the class the folder names.

        Raises:
            ValueError: no tokenizer folder is set, or its class is not a transformers
                tokenizer.
        """
        if self.options.tokenizer is None:
            raise ValueError(
                f"kind '{self.kind}' needs its tokenizer: set options.tokenizer to the "
                "folder of its tokenizer files"
            )
        folder = Path(self.options.tokenizer)
        name = self.options.tokenizer_class or _configured_class(folder)
        tokenizer_class = library_class("transformers", name, "PreTrainedTokenizerBase")
        return tokenizer_class.from_pretrained(str(folder), local_files_only=True)  # type: ignore[attr-defined]

    def tokenize(self, texts: Sequence[str], length: int, *, longest: bool = False) -> Tokens:
        """Tokenise ``texts``, truncated and padded to ``length`` tokens, specials included;
        ``longest``: padded only to the longest of them."""
        with self._calls:
            out = self.tokenizer(
                list(texts),
                padding="longest" if longest else "max_length",
                max_length=length,
                truncation=True,
                add_special_tokens=True,
                return_tensors="pt",
            )
        return Tokens(out.input_ids, out.attention_mask)

    def truncated(self, texts: Sequence[str], length: int) -> list[bool]:
        """Tell which of ``texts`` ``tokenize`` cuts to ``length`` tokens: those that still
        fill ``length + 1``."""
        with self._calls:
            longer = self.tokenizer(list(texts), max_length=length + 1, truncation=True).input_ids
        return [len(ids) > length for ids in longer]


def _configured_class(folder: Path) -> str:
    path = folder / TOKENIZER_CONFIG
    try:
        name = json.loads(path.read_text()).get("tokenizer_class")
    except (OSError, ValueError, AttributeError) as err:
        raise ValueError(f"cannot read the tokenizer class from {path} ({err})") from err
    if not isinstance(name, str):
        raise ValueError(f"{path} names no tokenizer_class; set options.tokenizer_class")
    return name
