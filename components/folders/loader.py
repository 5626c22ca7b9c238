"""``FolderLoader``: the kinds that load one component folder of a diffusers-format pipeline.

A component folder holds a ``config.json`` and safetensors weights (sharded or not).
Everything admission asks is answered from those two without loading: the tensors the
class expects (built on ``meta`` from the config), the bytes (from the headers), the
widths it reads and writes (from the config). The native path builds the library's
own class on ``meta`` and hands it the mapped tensors: one copy of the weights.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Hashable
from contextlib import AbstractContextManager, nullcontext
from functools import cached_property
from pathlib import Path
from typing import Any, ClassVar, NamedTuple

import torch
from torch import nn

from components.folders.files import Variant, stored_tensors, weight_files
from components.folders.layouts import layout_key, leave_spare, remembered, take_spare
from components.folders.meta import Expected, assign_weights, build_empty, expected_tensors
from components.folders.names import module_names
from components.libraries import Library, library_class, missing
from components.loader import ComponentLoader, KindOptions, LoaderPath, PathUnavailable
from components.sites import build_layers
from components.weights import DeclaredTensors, StoredTensor, is_floating, tensor_bytes

__all__ = ["CONFIG_FILE", "FolderLoader", "FolderOptions", "Layout"]

CONFIG_FILE = "config.json"


class Layout(NamedTuple):
    """How a folder's tensors fit its class.

    Attributes:
        expected: the tensors the class expects, and the buffers it computes.
        names: each stored tensor's name in the module -> its key in the files.
    """

    expected: Expected
    names: dict[str, str]


MODEL_BASES: dict[Library, str] = {"diffusers": "ModelMixin", "transformers": "PreTrainedModel"}
"""The class every model a folder names must derive from, per library."""


class FolderOptions(KindOptions, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Options of a kind loaded from a component folder.

    Attributes:
        path: the component folder (``config.json`` and safetensors weights).
        class_name: the library class to build (``model_index.json`` names it); None takes
            the one ``config.json`` names.
        variant: the variant of the weight files to read (``fp16``: the
            ``*.fp16.safetensors`` files a hub repository ships beside the full ones);
            None reads the files without a variant.

    Raises:
        ValueError: ``weights`` was given (the folder's own files are the weights).
    """

    files: ClassVar[tuple[str, ...]] = ("weights", "path")

    path: str
    class_name: str | None = None
    variant: Variant | None = None

    def __post_init__(self) -> None:
        if self.weights is not None:
            raise ValueError(
                "a folder component reads its weights from the safetensors files of its "
                "folder (options.path); drop options.weights"
            )


class FolderLoader(ComponentLoader):
    """Load a component from its folder through the library class it names.

    Subclasses set ``kind``, ``library``, ``classes`` (the classes of that library the
    kind loads), ``block_stack``, and the widths ``reads``/``writes`` take from
    ``config``. Weights are safetensors only; ``dtype`` may differ from the files' (each
    floating tensor is cast once, as it is assigned).
    """

    library: ClassVar[Library]
    options_type = FolderOptions
    dtypes = ("float32", "bfloat16", "float16")

    def __init__(self, options: FolderOptions) -> None:
        super().__init__(options)
        self.options: FolderOptions = options

    @property
    def folder(self) -> Path:
        """The component folder."""
        return Path(self.options.path)

    @cached_property
    def config(self) -> dict[str, Any]:
        """The folder's ``config.json``, read once.

        Raises:
            FileNotFoundError: the folder has no ``config.json``.
            ValueError: it is not a JSON object.
        """
        path = self.folder / CONFIG_FILE
        if not path.is_file():
            raise FileNotFoundError(f"{path} does not exist: a component folder holds its config")
        try:
            config = json.loads(path.read_text())
        except ValueError as err:
            raise ValueError(f"{path} is not valid JSON ({err})") from err
        if not isinstance(config, dict):
            raise ValueError(f"{path} holds {type(config).__name__}, not a JSON object")
        return config

    @property
    def class_name(self) -> str:
        """The class to build: the option, else the one ``config.json`` names."""
        if self.options.class_name is not None:
            return self.options.class_name
        if self.library == "transformers":
            return str((self.config.get("architectures") or [""])[0])
        return str(self.config.get("_class_name", ""))

    def unavailable_reason(self, path: LoaderPath) -> str | None:
        """Say why ``path`` cannot build this component here (the path, its library, files,
        class)."""
        reason = super().unavailable_reason(path)
        if reason is None and path == "native":
            reason = missing(self.library)
        return reason or self._folder_problem()

    def _folder_problem(self) -> str | None:
        try:
            self.config  # noqa: B018  (read to find a missing or broken file early)
            weight_files(self.folder, self.options.variant)
        except (OSError, ValueError) as err:
            return str(err)
        if self.class_name not in self.classes:
            return f"kind '{self.kind}' loads {', '.join(self.classes)}, not '{self.class_name}'"
        return None

    @cached_property
    def stored(self) -> dict[str, tuple[StoredTensor, Path]]:
        """Every tensor of the folder's weights files by name, with its file (headers only).

        Raises:
            UnsafeWeightsError: the folder's weights are only pickled files.
            VariantError: it has no safetensors of the variant asked for.
            FileNotFoundError: it has no weights, or a listed shard is missing.
            ValueError: a file is not safetensors, or two hold the same tensor.
        """
        return stored_tensors(weight_files(self.folder, self.options.variant))

    @cached_property
    def layout(self) -> Layout | None:
        """What the kind declares: the tensors its module expects and the module name of each
        stored tensor (see ``declared_layout``); None when that cannot be known here.

        The process keeps the layouts it declared (``components.folders.layouts``): one
        computed from the same kind, options, config and headers is not built again.

        Raises:
            OSError, ValueError: as ``stored`` does, or a tensor needs a conversion the
                library does and this version does not.
        """
        return remembered(self.layout_key, self.declared_layout)

    @cached_property
    def layout_key(self) -> Hashable:
        """What the layout, and the modules built to declare it, are computed from
        (``components.folders.layouts``).

        Raises:
            OSError, ValueError: as ``config`` and ``stored`` do.
        """
        return layout_key(type(self), self.options, self.config, self.stored)

    def declared_layout(self) -> Layout | None:
        """Return the library class's layout (``library_layout``); a kind with a custom path
        declares its own module's instead."""
        return self.library_layout

    @cached_property
    def library_layout(self) -> Layout | None:
        """What the library class expects and the module name of each stored tensor; None
        without the library (both come from building the class on ``meta``).

        The process keeps it as it keeps ``layout`` (by ``layout_key``): a native load of a
        folder loaded before renames no key and walks no module to declare it again.

        Raises:
            OSError, ValueError: as ``stored`` does, or a tensor needs a conversion the
                library does and this version does not.
        """
        if missing(self.library) is not None:
            return None
        return remembered((self.layout_key, "library"), self._library_layout)

    def _library_layout(self) -> Layout:
        module = self.construct("native")
        return Layout(expected_tensors(module), module_names(self.library, module, self.stored))

    def custom_module(self) -> nn.Module:
        """Construct the project's module from ``config`` (a kind with a custom path): its
        weights, and a ``SiteLayer`` where each attention layer goes, not built yet."""
        raise NotImplementedError(f"kind '{self.kind}' has no module of its own")

    def custom_layout(self) -> Layout:
        """Return what our module expects; every stored tensor keeps its own name.

        The module, built on ``meta`` for this, is left as the spare of the layout's key:
        the next custom build of the folder gives it its attention layers and weights
        (``custom_empty``), so it is built once from admission to load.

        Raises:
            OSError, ValueError: as ``stored`` does.
        """
        module = build_empty(self.custom_module)
        names = {key: key for key in self.stored}
        leave_spare((self.layout_key, "custom"), module)
        return Layout(expected_tensors(module), names)

    def custom_empty(self) -> nn.Module:
        """Return our module on ``meta``, its attention layers built in the current scope.

        The spare a declaration left is taken (once); any later build makes its own.
        """
        module = take_spare((self.layout_key, "custom"), lambda: build_empty(self.custom_module))
        build_layers(module)
        return module

    def tensors(self) -> DeclaredTensors | None:
        """Declare the tensors the class expects (tied names once); None without the library."""
        layout = self.layout
        return None if layout is None else layout.expected.tensors

    def weight_problems(self) -> list[str]:
        """Say how the folder's weights fail what the class expects, from headers alone.

        Raises:
            OSError, ValueError: as ``layout`` does.
        """
        layout = self.layout
        if layout is None:
            return []
        stored = {name: self.stored[key][0] for name, key in layout.names.items()}
        return layout.expected.problems(stored)

    def declared_bytes(self) -> int:
        """Return the bytes the module holds once loaded in ``dtype``, from headers and config.

        Floating tensors take ``dtype``'s size (float32 where the class keeps them so);
        integer ones keep their stored size. Buffers the class computes rather than
        stores (known from the ``meta`` build) count as well.

        Raises:
            OSError, ValueError: as ``stored`` does.
        """
        keeps_float32 = self.float32_rule()

        def loaded(name: str, floating: bool, stored: int, numel: int) -> int:
            if not floating:
                return stored
            dtype = torch.float32 if keeps_float32(name) else self.dtype
            return numel * dtype.itemsize

        total = sum(
            loaded(name, is_floating(tensor), tensor_bytes(name, tensor, path), _numel(tensor))
            for name, (tensor, path) in self.stored.items()
        )
        layout = self.layout
        if layout is not None:
            total += sum(
                loaded(name, b.is_floating_point(), b.numel() * b.element_size(), b.numel())
                for name, b in layout.expected.unstored.items()
            )
        return total

    def float32_rule(self) -> Callable[[str], bool]:
        """Return what tells whether the class keeps a tensor in float32 at this ``dtype``.

        transformers keeps its ``_keep_in_fp32_modules`` in float32 when loading in
        float16, and its ``_keep_in_fp32_modules_strict`` in float16 and bfloat16.
        """
        if self.dtype == torch.float32 or missing(self.library) is not None:
            return lambda name: False
        model = self.model_class()
        kept = set(getattr(model, "_keep_in_fp32_modules_strict", None) or ())
        if self.dtype == torch.float16:
            kept |= set(getattr(model, "_keep_in_fp32_modules", None) or ())
        return lambda name: not kept.isdisjoint(name.split("."))

    def model_class(self) -> type[nn.Module]:
        """Return the library class to build.

        Raises:
            ModuleNotFoundError: the library is not installed.
            ValueError: the library has no such model class.
        """
        found: type[nn.Module] = library_class(
            self.library, self.class_name, MODEL_BASES[self.library]
        )
        return found

    def construct(self, path: LoaderPath) -> nn.Module:
        """Return the class built from ``config.json`` with no weights (parameters on ``meta``).

        The module is left as the spare of the layout's key: admission inspects it (its
        tensors, its block stack) and the next native build of the folder gives it the
        weights, so a folder's class is built once from admission to load.

        Raises:
            NotImplementedError: ``path`` is custom (these kinds have only the native path).
        """
        if path == "custom":
            return super().construct(path)
        key = (self.layout_key, "native")
        module = take_spare(key, self.empty)
        leave_spare(key, module)
        return module

    def build(self, path: LoaderPath) -> nn.Module:
        """Build the module through ``path`` with the folder's weights, in eval mode, no grad,
        split as the layout asks (the custom path only)."""
        module = self.build_native() if path == "native" else self.build_custom()
        module.eval()
        module.requires_grad_(False)
        self.split(module, path)
        return module

    def empty(self) -> nn.Module:
        """Build the class from ``config.json`` with its parameters on ``meta``, uninitialised.

        Initialisers are skipped through the library's own switch (as its loading does):
        on meta tensors they do nothing but cost time. Buffers are made on the CPU, also
        under an enclosing ``torch.device`` (admission's meta build): the class computes
        some (position tables) that no file stores.
        """
        model = self.model_class()
        if self.library == "transformers":
            from transformers.initialization import no_init_weights

            config = model.config_class.from_dict(self.config)  # type: ignore[attr-defined]
            with no_init_weights(), _on_cpu():
                module = build_empty(lambda: model(config))
            # skipping transformers' init_weights skips its tying too (T5's shared embedding)
            module.tie_weights()  # type: ignore[operator]
            return module
        from diffusers.models.modeling_utils import no_init_weights as no_diffusers_init

        with no_diffusers_init(), _on_cpu():
            return build_empty(lambda: model.from_config(self.config))  # type: ignore[attr-defined]

    def build_native(self) -> nn.Module:
        """Build the library's class on ``meta`` and give it the folder's mapped weights.

        Raises:
            PathUnavailable: the library or a file is missing, or the class is not this kind's.
            ValueError: the files do not hold every weight the class expects.
        """
        reason = self.unavailable_reason("native")
        if reason is not None:
            raise PathUnavailable(f"the native path of '{self.kind}' cannot run here: {reason}")
        layout = self.library_layout
        assert layout is not None  # the library is installed: unavailable_reason said so
        module = take_spare((self.layout_key, "native"), self.empty)
        stored = {name: (self.stored[key][1], key) for name, key in layout.names.items()}
        # transformers keeps the buffers its classes compute as they computed them
        cast = self.library != "transformers"
        assign_weights(module, stored, self.dtype, self.float32_rule(), cast_buffers=cast)
        return module


def _on_cpu() -> AbstractContextManager[object]:
    """Make tensors on the CPU inside the block: a ``torch.device`` only where another
    device is the default, since that mode sees every torch call a constructor makes
    (about 1 us each, a sixth of building a DiT empty)."""
    return nullcontext() if torch.get_default_device().type == "cpu" else torch.device("cpu")


def _numel(tensor: StoredTensor) -> int:
    return math.prod(tensor.shape)
