"""What a component kind declares, and the paths that build it.

A kind is a ``ComponentLoader`` subclass. It declares everything admission
needs without building anything: its options, its attention sites, whether an
explicit global backend may fall back for it, which parallel layouts its
custom path honours. A path exists when the subclass overrides its builder
(``build_custom``, ``build_native``), never because a flag says so.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from contextlib import nullcontext
from functools import partial
from itertools import chain
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Literal, Self, TypeAlias

import msgspec
import torch
from torch import nn

from components.batch import Batch, Port
from components.cache import CacheSettings
from components.compile import CompileMode
from components.dtypes import DType
from components.mesh import ComponentParallel
from components.offload.base import OffloadError
from components.quantize import Quantization
from components.random_fills import RandomFillsSkipped, is_parameter
from components.sites import AttentionSite
from components.weights import DeclaredTensors, load_weights, seed_weights, stored_bytes

if TYPE_CHECKING:
    from torch.distributed.fsdp import FSDPModule

__all__ = ["ComponentLoader", "KindOptions", "LoaderPath", "PathUnavailable", "SeededOptions"]

LoaderPath: TypeAlias = Literal["custom", "native"]
FLOAT32_BYTES = 4
INT64_BYTES = 8


class KindOptions(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Options every kind takes; a kind's own options subclass this.

    Attributes:
        weights: a safetensors file to read the weights from.
    """

    files: ClassVar[tuple[str, ...]] = ("weights",)
    """The options that name a file or folder: a spec reads a relative one from its own
    folder, as it reads ``source``."""

    weights: str | None = None


class SeededOptions(KindOptions, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Options of a kind whose weights are made from a seed when no file is given.

    Attributes:
        seed: the seed of the weights; exclusive with ``weights``.

    Raises:
        ValueError: both ``seed`` and ``weights`` were given (one would be ignored).
    """

    seed: int | msgspec.UnsetType = msgspec.UNSET

    def __post_init__(self) -> None:
        if self.weights is not None and not isinstance(self.seed, msgspec.UnsetType):
            raise ValueError(
                "seed and weights exclude each other: the weights come from the file; "
                "drop one of them"
            )

    @property
    def seed_value(self) -> int:
        """Return the seed, 0 when none was written."""
        return 0 if isinstance(self.seed, msgspec.UnsetType) else self.seed


class ComponentLoader:
    """Declare and build one kind of component.

    Subclasses set ``kind`` and ``options_type`` and override what they have:
    ``sites`` (the attention layers the custom path builds), ``build_custom``
    (the project's own implementation, built on ``attention.Attention``),
    ``build_native`` (a plain-PyTorch or library implementation that does not
    go through the attention package).

    Attributes:
        options: the validated options of this component.
    """

    kind: ClassVar[str]
    options_type: ClassVar[type[KindOptions]] = KindOptions
    allows_global_fallback: ClassVar[bool] = False
    """Whether an explicit global backend this kind cannot serve may fall back."""
    block_stack: ClassVar[str | tuple[str, ...] | None] = None
    """The attribute (a dotted path) holding the ``nn.ModuleList`` that layerwise offload
    streams, or several, whose blocks stream one stack after the other (Flux's double-stream
    then single-stream blocks)."""
    unstreamable: ClassVar[str | None] = None
    """Why a kind without a block stack has none, where that is a property of the model (a
    refused layerwise offload says it)."""
    sequence_parallel: ClassVar[bool] = False
    """Whether the custom path splits sequences (ring attention applies to its self sites);
    a kind that says so implements ``parallelize``."""
    tensor_parallel: ClassVar[bool] = False
    """Whether the custom path splits heads over the ``tp`` ranks (in ``parallelize``)."""
    guidance_parallel: ClassVar[bool] = False
    """Whether ``run`` splits classifier-free guidance's two branches over the cfg ranks."""
    fully_shardable: ClassVar[bool] = False
    """Whether the custom path's module works sharded by FSDP2 ``fully_shard``: it is
    called only through its ``forward`` (where FSDP gathers the weights)."""
    classes: ClassVar[tuple[str, ...]] = ()
    """The library classes this kind loads, as a pipeline folder's ``model_index.json`` names
    them (``T5EncoderModel``): a folder's component of such a class is of this kind."""
    switchable_backends: ClassVar[bool] = False
    """Whether a request's ``attention_backend`` may switch the sites the spec left unset."""
    dtypes: ClassVar[tuple[DType, ...]] = ("float32",)
    """The dtypes this kind builds its floating weights in (``dtype`` must be one)."""
    step_cache: ClassVar[bool] = False
    """Whether the custom path honours a step cache (design §17): ``run`` (or its recipe's
    denoising loop) hands its block stack a ``components.cache.StepCache`` each step."""
    adapter_rows: ClassVar[bool] = False
    """Whether rows naming different unmerged adapters may share one forward: every linear
    layer's input keeps the batch's rows in order on its leading dimension (once, or
    repeated for guidance), or the kind says where they lie (``components.adapters.rows``).
    Otherwise such rows run in separate batches."""

    def __init__(self, options: KindOptions) -> None:
        self.options = options
        self.parallel: ComponentParallel | None = None
        """How this component is split on this rank; set before ``build`` (None: whole)."""
        self.cache: CacheSettings | None = None
        """Its step cache (``[components.NAME.cache]``), set before it runs; None: none."""
        self.dtype: torch.dtype = torch.float32
        """The dtype of its floating weights once built; set before sizing or building."""
        self.quantization: Quantization = "off"
        """How its linear weights are quantized once built (``components.quantize``)."""
        self.quantized_saving = 0
        """The bytes quantization takes off the declared ones: admission sizes the linear
        weights of the module built on the meta device."""
        self.compile: CompileMode = "off"
        """How its forward is compiled once built (``components.compile``)."""

    @classmethod
    def from_options(cls, raw: Mapping[str, Any]) -> Self:
        """Validate the raw ``options`` table of a spec.

        Raises:
            msgspec.ValidationError: an option is unknown or has a bad value.
        """
        return cls(msgspec.convert(dict(raw), cls.options_type))

    def sites(self) -> tuple[AttentionSite, ...] | None:
        """Return the attention sites the custom path builds; None when unknown."""
        return ()

    def declared_bytes(self) -> int | None:
        """Return the bytes the weights will take, known without building; None if unknown.

        From the weights file's header when one is given, else from the tensors the
        kind declares (float32 weights, int64 integer buffers).
        """
        if self.options.weights is not None:
            return stored_bytes(Path(self.options.weights))
        declared = self.tensors()
        if declared is None:
            return None
        return sum(
            math.prod(t.shape) * (FLOAT32_BYTES if t.floating else INT64_BYTES)
            for t in declared.values()
        )

    def tensors(self) -> DeclaredTensors | None:
        """Return the tensors the module holds, by name, from the options; None if unknown.

        A weights file is held to this from its header before anything is built.
        """
        return None

    def block_count(self) -> int | None:
        """Return how many blocks the block stack will hold, from the options; None if none."""
        return None

    def blocks_run(self) -> int | None:
        """Return how many of the first blocks a forward runs; None: every block."""
        return None

    def blocks(self, module: nn.Module) -> nn.ModuleList | None:
        """Return the blocks of ``module`` that layerwise offload streams, in the order they run.

        With several stacks the blocks are gathered into one list (which ``module`` does
        not hold: the blocks stay where they are). None when the kind declares no stack.
        Admission calls this on the module built on the meta device and the orchestrator
        on the loaded one, so an explicit layerwise offload is never silently whole.

        Raises:
            OffloadError: a declared stack is missing or is not an ``nn.ModuleList``.
        """
        if self.block_stack is None:
            return None
        paths = (self.block_stack,) if isinstance(self.block_stack, str) else self.block_stack
        stacks = [self._block_list(module, path) for path in paths]
        return stacks[0] if len(stacks) == 1 else nn.ModuleList(chain.from_iterable(stacks))

    def _block_list(self, module: nn.Module, path: str) -> nn.ModuleList:
        found: object = module
        for name in path.split("."):
            found = getattr(found, name, None)
        if isinstance(found, nn.ModuleList):
            return found
        what = (
            f"builds no attribute '{path}' for its block stack"
            if found is None
            else f"builds its block stack '{path}' as a {type(found).__name__}, "
            "not an nn.ModuleList"
        )
        raise OffloadError(
            f"kind '{self.kind}' {what}: layerwise offload streams the blocks of an "
            "nn.ModuleList; make it one, or use component_offload"
        )

    def reads(self) -> tuple[Port, ...]:
        """Return the ``Batch`` fields ``run`` uses when an earlier stage wrote them."""
        return ()

    def writes(self) -> tuple[Port, ...]:
        """Return the ``Batch`` fields ``run`` stores."""
        return ()

    def run(self, module: nn.Module, batch: Batch) -> None:
        """Run ``module`` on what ``batch`` carries and store what it produces there.

        Raises:
            NotImplementedError: the kind does not say how it runs in a request.
        """
        raise NotImplementedError(
            f"kind '{self.kind}' does not say how it runs in a request; implement "
            "ComponentLoader.run for it to be driven by `lifecycle run`"
        )

    def build_custom(self) -> nn.Module:
        """Build the project's own implementation (inside an attention scope)."""
        raise NotImplementedError

    def build_native(self) -> nn.Module:
        """Build the native implementation, which uses no ``attention.Attention``."""
        raise NotImplementedError

    def parallelize(self, module: nn.Module, parallel: ComponentParallel) -> None:
        """Split the custom path's ``module`` (with its weights) for sequence or tensor parallel.

        Raises:
            NotImplementedError: the kind declares a split it does not implement.
        """
        raise NotImplementedError(
            f"kind '{self.kind}' declares sequence or tensor parallel but does not "
            "implement ComponentLoader.parallelize"
        )

    @classmethod
    def has_path(cls, path: LoaderPath) -> bool:
        """Tell whether this kind overrides the builder of ``path``."""
        builder = f"build_{path}"
        return getattr(cls, builder) is not getattr(ComponentLoader, builder)

    def unavailable_reason(self, path: LoaderPath) -> str | None:
        """Say why ``path`` cannot build this component here, or None when it can.

        Kinds whose path needs an optional library extend this.
        """
        if not self.has_path(path):
            return f"kind '{self.kind}' has no {path} loading path"
        if self.options.weights is not None and not Path(self.options.weights).is_file():
            return f"its weights file '{self.options.weights}' does not exist"
        return None

    def cache_problem(self, path: LoaderPath, settings: CacheSettings) -> str | None:
        """Say why ``path`` cannot honour the step cache ``settings`` (design §17), or None
        when it can.

        Kinds whose native class may have a cache hook of its own extend this.
        """
        if not self.step_cache:
            return f"kind '{self.kind}' runs no denoising block stack a cache could skip"
        if path == "native":
            return f"the native path of kind '{self.kind}' has no cache hook"
        return None

    def construct(self, path: LoaderPath) -> nn.Module:
        """Construct the bare module through ``path``: no weights set, nothing split.

        Under ``torch.device("meta")`` this allocates nothing: admission looks at what
        a kind builds that way (its block stack) without loading it.
        """
        return self.build_custom() if path == "custom" else self.build_native()

    def build(self, path: LoaderPath) -> nn.Module:
        """Build the module through ``path``, in eval mode, with no gradients, with its weights.

        The weights come from ``options.weights`` when set, else from the seed of a kind
        whose options are ``SeededOptions`` (others keep what their builder made); both
        paths of a kind name their tensors alike, so one seed or one file gives both the
        same weights.

        Raises:
            FileNotFoundError: ``options.weights`` does not exist.
            ValueError: the file's tensors do not match the module's names or shapes.
        """
        written = self.options.weights is not None or isinstance(self.options, SeededOptions)
        # a file or a seed writes every parameter next: the constructor's draws go unread
        with RandomFillsSkipped(is_parameter) if written else nullcontext():
            module = self.construct(path)
        if self.options.weights is not None:
            load_weights(module, Path(self.options.weights))
        elif isinstance(self.options, SeededOptions):
            seed_weights(module, self.options.seed_value)
        module.eval()
        module.requires_grad_(False)
        self.split(module, path)
        return module

    def split(self, module: nn.Module, path: LoaderPath) -> None:
        """Keep this rank's part of a custom path's module under the layout (``parallel``):
        sequence and tensor splits through ``parallelize``, then FSDP2. A native path and
        a replicated component stay whole."""
        parallel = self.parallel
        if path == "custom" and parallel is not None:
            # every rank made the same whole weights; the splits keep this rank's part
            if parallel.sequence is not None or parallel.tensor is not None:
                self.parallelize(module, parallel)
            if parallel.fsdp is not None:
                # imported here: torch.distributed.fsdp (with torch.distributed.tensor)
                # costs ~1 CPU-s, which only a process whose layout shards should pay
                from torch.distributed.fsdp import fully_shard

                sharded = fully_shard(module, mesh=parallel.fsdp)
                # FSDP keeps a root module gathered after forward, for a backward that
                # inference never runs: shard it again so a rank holds 1/n between uses
                module.register_forward_hook(partial(_reshard, sharded))


def _reshard(sharded: FSDPModule, *hook_args: object) -> None:
    """A forward hook of ``sharded`` itself: shard its weights again (None keeps the output)."""
    sharded.reshard()


class PathUnavailable(RuntimeError):
    """A loading path found at build time that it cannot run here (say why)."""
