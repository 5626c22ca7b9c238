"""``CustomFolderLoader``: a folder kind whose custom path is the project's own module.

Our module names its tensors as the folder's files name them, so loading is the native
path's without a library: build the module with its parameters on ``meta``, check the
files' names and shapes against it (strictly: nothing missing, nothing extra, no
renaming, no conversion), and hand it the mapped tensors (one copy). What admission
asks is answered from the same module's declaration, the very module the load then
fills: no library is imported, and the module is built once.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import ClassVar

import torch
from torch import nn

from components.folders.loader import FolderLoader, Layout
from components.folders.meta import assign_weights
from components.loader import LoaderPath, PathUnavailable

__all__ = ["CustomFolderLoader"]


class CustomFolderLoader(FolderLoader):
    """A folder kind with our own module on ``attention.Attention``: the default path.

    Subclasses implement ``custom_module`` (our module from ``config``, on the sites of
    ``sites()``) and may say what of the config the module does not implement
    (``custom_problem``). ``loader = "native"`` still builds the library's class.
    """

    float16_keeps_float32: ClassVar[tuple[str, ...]] = ()
    """Names of submodules kept in float32 when loading in float16, as the library's class
    keeps them (its ``_keep_in_fp32_modules``)."""

    def custom_problem(self) -> str | None:
        """Say what the folder's config asks that our module does not implement, or None."""
        return None

    def unavailable_reason(self, path: LoaderPath) -> str | None:
        """Say why ``path`` cannot build this component: the custom path needs no library,
        only readable files and a config our module implements."""
        reason = super().unavailable_reason(path)
        if reason is None and path == "custom":
            reason = self.custom_problem()
        return reason

    def declared_layout(self) -> Layout:
        """Return our module's tensors (``custom_layout``), also on the native path.

        Raises:
            OSError, ValueError: as ``stored`` does.
        """
        return self.custom_layout()

    def float32_rule(self) -> Callable[[str], bool]:
        """Keep ``float16_keeps_float32`` in float32 under float16, as the library does."""
        kept = set(self.float16_keeps_float32) if self.dtype == torch.float16 else set()
        return lambda name: not kept.isdisjoint(name.split("."))

    def build_custom(self) -> nn.Module:
        """Build our module on ``meta`` and give it the folder's mapped tensors by their names.

        Raises:
            PathUnavailable: a file is missing, or the config asks what our module lacks.
            ValueError: the files' names or shapes are not exactly the module's.
        """
        reason = self.unavailable_reason("custom")
        if reason is not None:
            raise PathUnavailable(f"the custom path of '{self.kind}' cannot run here: {reason}")
        problems = self.weight_problems()
        if problems:
            raise ValueError(
                f"the weights in {self.folder} do not fit the custom path of '{self.kind}': "
                + "; ".join(problems[:5])
                + '; load it with loader = "native" (the library renames or converts old '
                "checkpoints)"
            )
        module = self.custom_empty()
        stored = {key: (path, key) for key, (_, path) in self.stored.items()}
        assign_weights(module, stored, self.dtype, self.float32_rule())
        return module
