"""``DitLoader``: the kinds of a folder's DiT, with the project's own path as the default.

The custom path builds the project's module (``PackedTransformer``) with its parameters
on ``meta`` and hands it the folder's mapped tensors under the very names diffusers
uses: no conversion, no second copy. It needs neither diffusers nor its classes, and
admission declares the module from the one the load then fills; the native path
(``loader = "native"``) still builds diffusers' own class.
"""

from __future__ import annotations

from torch import nn

from attention import AttentionRequirements, AttentionRole
from components.cache import CacheSettings
from components.cache.native import hook_problem
from components.folders.files import weight_files
from components.folders.loader import FolderLoader, FolderOptions, Layout
from components.folders.meta import assign_weights
from components.libraries import missing
from components.loader import LoaderPath, PathUnavailable
from components.mesh import ComponentParallel
from components.models.dit.base import PackedTransformer
from components.sites import NO_REQUIREMENTS, AttentionSite

__all__ = ["DitLoader"]


class DitOptions(FolderOptions, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Options of a folder's DiT.

    Attributes:
        packed_sequences: the custom path attends every request of a forward in one
            packed varlen call (needs a packed-varlen backend); false attends one request
            at a time, densely, on any backend.
    """

    packed_sequences: bool = True


class DitLoader(FolderLoader):
    """Load a folder's DiT: the denoiser, strict about global backends, splittable.

    Subclasses set ``kind``, ``classes`` and ``block_stack``, and implement
    ``custom_module`` (and ``custom_problem`` for configs the custom path does not
    build).
    """

    library = "diffusers"
    options_type = DitOptions
    sequence_parallel = True
    tensor_parallel = True
    fully_shardable = True
    step_cache = True
    switchable_backends = True  # the denoiser: requests may name its backend (design §4.6)

    def __init__(self, options: DitOptions) -> None:
        super().__init__(options)
        self.options: DitOptions = options

    @property
    def heads(self) -> int:
        """Return the attention heads of every block."""
        return int(self.config["num_attention_heads"])

    def self_site(self) -> AttentionSite:
        """Return the ``self`` site: each request's tokens together (joint text + image)."""
        packed = AttentionRequirements(packed_varlen=True)
        return AttentionSite(
            name="self",
            role=AttentionRole.SELF,
            heads=self.heads,
            requirements=packed if self.options.packed_sequences else NO_REQUIREMENTS,
        )

    def sites(self) -> tuple[AttentionSite, ...]:
        """Declare the ``self`` site (subclasses add more)."""
        return (self.self_site(),)

    def custom_problem(self) -> str | None:
        """Say which part of ``config`` the custom path does not build, or None."""
        return None

    def unavailable_reason(self, path: LoaderPath) -> str | None:
        """Say why ``path`` cannot build this component here (files, config, library)."""
        if path == "native":
            return super().unavailable_reason(path)
        try:
            self.config  # noqa: B018  (read to find a missing or broken file early)
            weight_files(self.folder, self.options.variant)
        except (OSError, ValueError) as err:
            return str(err)
        return self.custom_problem()

    def declared_layout(self) -> Layout | None:
        """What the module expects: our module's (``custom_layout``), which holds diffusers'
        names and shapes (a test holds them to it); diffusers' class's where our module
        does not build the config and diffusers is installed.

        Raises:
            OSError, ValueError: as ``stored`` does.
        """
        if self.custom_problem() is not None and missing(self.library) is None:
            return self.library_layout
        return self.custom_layout()

    def cache_problem(self, path: LoaderPath, settings: CacheSettings) -> str | None:
        """On the native path, honour only what diffusers' own cache hook does as written
        (``components.cache.native``); the custom path runs every cache."""
        if path != "native":
            return super().cache_problem(path, settings)
        try:
            model = self.model_class()
        except (ImportError, OSError, ValueError) as err:
            return f"its native class cannot be read to find a cache hook ({err})"
        hooked = any(base.__name__ == "CacheMixin" for base in model.__mro__)
        return hook_problem(settings, self.class_name, hooked)

    def parallelize(self, module: nn.Module, parallel: ComponentParallel) -> None:
        """Shard the packed joint rows (sp) and the heads and MLP units (tp) of the DiT."""
        assert isinstance(module, PackedTransformer)  # the custom path builds one
        module.parallelize(parallel)

    def build_custom(self) -> nn.Module:
        """Build the project's module on ``meta`` and give it the folder's mapped weights.

        Raises:
            PathUnavailable: a file is missing or the config asks for what it does not build.
            ValueError: the files' tensors do not match its names (every one named).
        """
        reason = self.unavailable_reason("custom")
        if reason is not None:
            raise PathUnavailable(f"the custom path of '{self.kind}' cannot run here: {reason}")
        layout = self.layout
        assert layout is not None  # our module's: the custom path builds this config
        expected = layout.expected.tensors
        module = self.custom_empty()
        extra = sorted(set(self.stored) - set(expected))
        if extra:
            shown = ", ".join(extra[:5]) + (f" and {len(extra) - 5} more" if len(extra) > 5 else "")
            raise ValueError(
                f"the folder's weights hold tensors the {self.kind} module does not: {shown}; "
                "its config does not describe its weights"
            )
        stored = {name: (self.stored[name][1], name) for name in expected if name in self.stored}
        assign_weights(module, stored, self.dtype)
        return module
