"""``clip_vision_encoder``: transformers' ``CLIPVisionModel``, Wan 2.1 I2V's image encoder.

The pipeline hands the DiT the penultimate layer's states of the input image (every
patch and the class token), which the DiT's cross-attention reads beside the text. The
image is prepared by the folder's image processor (``image_processor``, a transformers
class such as ``CLIPImageProcessor``), read from its JSON config alone.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from functools import cached_property
from pathlib import Path
from typing import Any, ClassVar

import torch
from torch import nn

from components.batch import Port, device_of
from components.folders.loader import FolderLoader, FolderOptions
from components.libraries import library_class
from components.loader import LoaderPath

__all__ = ["ClipVisionEncoderLoader"]

# B images, P patches (and the class token), E width


class VisionOptions(FolderOptions, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Options of a folder's image encoder.

    Attributes:
        processor: the folder of its image processor's config.
        processor_class: the transformers image processor class (``model_index.json``
            names it).
    """

    files: ClassVar[tuple[str, ...]] = ("weights", "path", "processor")

    processor: str | None = None
    processor_class: str | None = None


class ClipVisionEncoderLoader(FolderLoader):
    """Load ``CLIPVisionModel`` (native); its layers (``encoder.layers``) stream."""

    kind: ClassVar[str] = "clip_vision_encoder"
    library = "transformers"
    classes = ("CLIPVisionModel", "CLIPVisionModelWithProjection")
    block_stack = "encoder.layers"
    options_type = VisionOptions
    allows_global_fallback = True  # an auxiliary component (design §4.2)

    def __init__(self, options: VisionOptions) -> None:
        super().__init__(options)
        self.options: VisionOptions = options
        self._calls = threading.Lock()  # a processor is not known to be thread-safe

    def unavailable_reason(self, path: LoaderPath) -> str | None:
        """Say why ``path`` cannot build this component here; a missing processor counts."""
        reason = super().unavailable_reason(path)
        processor = self.options.processor
        if reason is None and processor is not None and not Path(processor).is_dir():
            return f"its image processor folder '{processor}' does not exist"
        return reason

    def block_count(self) -> int:
        """Return the encoder's layers (``num_hidden_layers``)."""
        return int(self.config["num_hidden_layers"])

    def writes(self) -> tuple[Port, ...]:
        """Write the image's states, ``hidden_size`` wide."""
        return (Port(field="image_context", width=int(self.config["hidden_size"])),)

    @cached_property
    def processor(self) -> Any:
        """The image processor, built on first use by the class the folder names.

        Raises:
            ValueError: no processor folder or class is set, or the class is not a
                transformers image processor.
        """
        if self.options.processor is None or self.options.processor_class is None:
            raise ValueError(
                f"kind '{self.kind}' needs its image processor: set options.processor and "
                "options.processor_class"
            )
        found = library_class("transformers", self.options.processor_class, "ImageProcessingMixin")
        return found.from_pretrained(self.options.processor, local_files_only=True)  # type: ignore[attr-defined]

    def encode(self, module: nn.Module, images: Sequence[Any]) -> torch.Tensor:
        """Return the penultimate layer's states ``(B, P, E)`` of ``images`` (PIL images)."""
        with self._calls:
            pixels = self.processor(images=list(images), return_tensors="pt").pixel_values
        out = module(pixel_values=pixels.to(device_of(module)), output_hidden_states=True)
        states: torch.Tensor = out.hidden_states[-2]
        return states
