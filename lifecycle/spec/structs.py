"""The spec's Structs: a pipeline, its components, stages and adapters, and its settings.

A key's presence is what makes a choice *explicit*: optional choices default to
``UNSET``, and the properties here give the effective value.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from msgspec import UNSET, UnsetType

from components import OffloadTarget, OffloadVerify, ParallelLayout, ResidencyMode
from components.cache import CacheSettings
from components.compile import CompileMode
from components.dtypes import DType
from components.folders.files import Variant
from components.quantize import Quantization
from lifecycle.spec.sizes import ByteSize

__all__ = [
    "ALL_ROLES",
    "DEFAULT_OFFLOAD_DIR",
    "AdapterMode",
    "AdapterSpec",
    "AttentionConfig",
    "ComponentSpec",
    "LayerwiseConfig",
    "MemoryConfig",
    "PipelineSpec",
    "ServingConfig",
    "StageSpec",
    "StatusPage",
    "WorkerFile",
    "WorkerSettings",
]

Loader = Literal["custom", "native"]
AdapterMode = Literal["merged", "unmerged"]
Device = Literal["cpu", "cuda", "auto"]
StatusPage = Literal["open", "private"]
Acceleration = Literal["off", "auto"]
ALL_ROLES = "all"
DEFAULT_OFFLOAD_DIR = ".lifecycle/offload"


class _Spec(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Base of the spec Structs: frozen, keyword-only, unknown keys refused."""


class AttentionConfig(_Spec, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Pipeline-wide attention settings.

    Attributes:
        backend: the global backend; explicit when present.
        backend_options: per-backend options, each validated by its backend.
    """

    backend: str | UnsetType = UNSET
    backend_options: dict[str, dict[str, Any]] = msgspec.field(default_factory=dict)


class MemoryConfig(_Spec, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Where weights may live.

    Attributes:
        device_budget: the most bytes resident on the device at once.
        offload_target: where offloaded weights go.
        offload_dir: the folder of the safetensors files for the disk target.
        verify_offload: how a disk-offload file is verified at onload:
            ``checksum`` (its identity, and its data against the checksums
            taken when it was written, hashed once per identity of the file)
            or ``stat`` (its size, mtime, ctime and inode only: never hashes).
        wait_timeout: seconds an onload waits for other requests to release what
            it needs before it is refused (design §5.5).
    """

    device_budget: ByteSize | UnsetType = UNSET
    offload_target: OffloadTarget = "host"
    offload_dir: str = DEFAULT_OFFLOAD_DIR
    verify_offload: OffloadVerify = "checksum"
    wait_timeout: Annotated[float, msgspec.Meta(ge=0)] = 60.0


DEFAULT_VIDEO_STORE_BYTES = 2**30
"""The finished videos a pipeline keeps when ``serving.video_store_bytes`` is unset."""


class ServingConfig(_Spec, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """How ``lifecycle serve`` queues, batches and bounds requests (design §5.5, §13).

    The bounds on one request and one connection are checked before any work is
    queued: a request over one is answered 400 naming its key (413 for the body, 431
    for the headers), never 500. Their defaults suit a worker on an open port:
    generous for what the endpoints serve, small against a hostile client.

    Attributes:
        max_batch: the most requests run together as one batch.
        max_batch_tokens: the most prompt tokens (text) or latent tokens (images) in
            one batch; a single request larger than this still runs, alone.
        batch_window_ms: how long the first request of a batch waits for others
            while another batch runs (an idle worker starts it at once).
        max_queue: requests of one priority waiting or running at once; one more of
            that priority is answered 429 (each priority has its own room, so batch
            jobs never lock interactive ones out).
        drain_timeout: seconds SIGTERM waits for in-flight requests before exiting
            (and a sleep, a swap or a removal waits for the pipeline's).
        wake_timeout: seconds a request for a sleeping pipeline waits for it to wake
            before it is answered 503 (with ``Retry-After``).
        auto_wake: whether a request for a sleeping pipeline wakes it.
        max_request_seconds: the longest a request may take, queued and running; a
            request's own ``timeout`` may be shorter. Past it the request is
            cancelled (design §15).
        max_priority: the highest ``priority`` a request may carry (0 is the
            default and the lowest); it also sets the ageing bound of
            ``lifecycle.device.priorities``.
        status_page: who may read the status page (``GET /``, ``/status``) and its event
            stream (``GET /v1/events``), which show every client's request ids and
            moves: ``open`` to every client, like ``/healthz``, or ``private``: only
            with the API key (``Authorization: Bearer``). Unset, the page is behind the
            API key when the worker has one, open when it has none
            (``lifecycle.serving.auth.page_access``).
        max_body_bytes: the largest request body (413 beyond; counted as it arrives,
            never read whole). 2 MiB holds ``max_inputs`` sentences of ~1,000
            characters, about what a 256-token encoder reads of each.
        max_inputs: embeddings inputs per request (OpenAI's own limit, 2048).
        max_input_chars: characters of one embeddings input; a text encoder reads
            only its first tokens (the response lists the inputs it truncated).
        max_n: images per request (OpenAI's limit for ``n``, 10).
        max_steps: denoising steps per request; samplers converge in 20 to 50.
        max_image_side: pixels of an image's width or height.
        max_pixels: pixels of every image of one request together (``n`` x width x
            height): 16 Mi is four 2048 x 2048 images or sixteen 1024 x 1024 ones.
        max_prompt_chars: characters of a prompt or negative prompt (OpenAI's 4,000).
        max_header_bytes: the request line and headers together (431 beyond).
        max_connections: open connections at once: one more is answered 503 and
            closed at once, and so is a request beyond it (uvicorn's
            ``limit_concurrency``).
        header_timeout: seconds a client has to send its request line and headers,
            from its connection or its previous response; then it is closed (408).
        body_timeout: seconds a client has to send a whole body once its headers
            arrived; then it is closed (408).
        warmup: warm-up requests run through every stage before ``/readyz`` answers
            200 (at least one: the worker reads what the pipeline produces off it).
        prompt_cache_bytes: host memory for encoded prompts of a pipeline from a folder
            (``lifecycle.prompts``): a batch whose prompts are all kept does not use its
            text encoders. Unset or 0 (the default) keeps none.
        max_frames: frames of one video (``POST /v1/videos``; Wan makes 81 by default).
        max_video_pixels: pixels of one video, frames x width x height: 128 Mi holds
            81 frames of 1280 x 720.
        video_ttl: seconds a finished video is kept for ``GET /v1/videos/{id}/content``
            once it finished; then it is removed (404).
        video_store_bytes: host memory for the finished videos of the pipeline (their
            MP4 files); past it the oldest finished first are removed. Unset: 1 GiB.
    """

    max_batch: Annotated[int, msgspec.Meta(ge=1)] = 16
    max_batch_tokens: Annotated[int, msgspec.Meta(ge=1)] = 8192
    batch_window_ms: Annotated[float, msgspec.Meta(ge=0)] = 5.0
    max_queue: Annotated[int, msgspec.Meta(ge=1)] = 256
    drain_timeout: Annotated[float, msgspec.Meta(ge=0)] = 30.0
    # the worker over time (design §13)
    wake_timeout: Annotated[float, msgspec.Meta(ge=0)] = 30.0
    auto_wake: bool = False
    # requests over time (design §15)
    max_request_seconds: Annotated[float, msgspec.Meta(gt=0)] = 600.0
    max_priority: Annotated[int, msgspec.Meta(ge=0, le=1000)] = 10
    status_page: StatusPage | UnsetType = UNSET
    # what one request and one connection may ask, and the start-up (design §13)
    max_body_bytes: Annotated[int, msgspec.Meta(ge=1)] = 2 * 2**20
    max_inputs: Annotated[int, msgspec.Meta(ge=1)] = 2048
    max_input_chars: Annotated[int, msgspec.Meta(ge=1)] = 32_768
    max_n: Annotated[int, msgspec.Meta(ge=1)] = 10
    max_steps: Annotated[int, msgspec.Meta(ge=1)] = 200
    max_image_side: Annotated[int, msgspec.Meta(ge=1)] = 2048
    max_pixels: Annotated[int, msgspec.Meta(ge=1)] = 16 * 2**20
    max_prompt_chars: Annotated[int, msgspec.Meta(ge=1)] = 4000
    max_header_bytes: Annotated[int, msgspec.Meta(ge=1)] = 32 * 2**10
    max_connections: Annotated[int, msgspec.Meta(ge=1)] = 512
    header_timeout: Annotated[float, msgspec.Meta(gt=0)] = 10.0
    body_timeout: Annotated[float, msgspec.Meta(gt=0)] = 30.0
    warmup: Annotated[int, msgspec.Meta(ge=1)] = 1
    # the prompt-embedding cache (design §19)
    prompt_cache_bytes: ByteSize | UnsetType = UNSET
    # the videos API (design §18)
    max_frames: Annotated[int, msgspec.Meta(ge=1)] = 161
    max_video_pixels: Annotated[int, msgspec.Meta(ge=1)] = 128 * 2**20
    video_ttl: Annotated[float, msgspec.Meta(gt=0)] = 3600.0
    video_store_bytes: ByteSize | UnsetType = UNSET

    @property
    def prompt_cache(self) -> int:
        """Return the prompt cache's bytes (``prompt_cache_bytes``; 0 when unset: none)."""
        return 0 if isinstance(self.prompt_cache_bytes, UnsetType) else self.prompt_cache_bytes

    @property
    def video_store(self) -> int:
        """Return the bytes of finished videos kept (``video_store_bytes``; 1 GiB when unset)."""
        if isinstance(self.video_store_bytes, UnsetType):
            return DEFAULT_VIDEO_STORE_BYTES
        return self.video_store_bytes


class LayerwiseConfig(_Spec, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """How a layerwise-offloaded component streams its blocks.

    Attributes:
        prefetch: blocks loaded ahead of the one that runs.
        resident_layers: the first blocks, kept on the device while it is resident.
    """

    prefetch: Annotated[int, msgspec.Meta(ge=0)] = 1
    resident_layers: Annotated[int, msgspec.Meta(ge=0)] = 0


class ComponentSpec(_Spec, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """One component of the pipeline.

    Attributes:
        kind: the built-in or installed kind that builds it (never a module path).
        residency: how it is kept on the device; ``resident`` when absent.
        attention_backend: a backend for the whole component, or a table with
            any of ``all``, ``self``, ``cross`` (a role key beats ``all``).
        loader: an explicit choice of the custom or native loading path.
        layerwise: block streaming settings, for ``layerwise_offload`` only.
        dtype: the dtype of its floating weights; the pipeline's ``dtype`` when absent.
        cache: its step cache (design §17), for a denoiser; none when absent.
        compile: how torch.compile compiles it (design §17): ``blocks`` (each block of
            its stack, one compiled code per block class), ``whole`` or ``off`` (absent).
        quantization: how torchao holds its linear weights (design §17); ``off`` when
            absent.
        options: the kind's own options, validated by the kind.
    """

    kind: Annotated[str, msgspec.Meta(min_length=1)]
    residency: ResidencyMode | UnsetType = UNSET
    attention_backend: str | dict[str, str] | UnsetType = UNSET
    loader: Loader | UnsetType = UNSET
    layerwise: LayerwiseConfig | UnsetType = UNSET
    dtype: DType | UnsetType = UNSET
    cache: CacheSettings | UnsetType = UNSET
    compile: CompileMode | UnsetType = UNSET
    quantization: Quantization | UnsetType = UNSET
    options: dict[str, Any] = msgspec.field(default_factory=dict)

    @property
    def compile_mode(self) -> CompileMode:
        """Return how it is compiled, ``off`` when nothing was written."""
        return "off" if isinstance(self.compile, UnsetType) else self.compile

    @property
    def quantization_mode(self) -> Quantization:
        """Return how its linear weights are quantized, ``off`` when nothing was written."""
        return "off" if isinstance(self.quantization, UnsetType) else self.quantization

    @property
    def cache_settings(self) -> CacheSettings | None:
        """Return its step cache, None when it has none."""
        return None if isinstance(self.cache, UnsetType) else self.cache

    @property
    def residency_mode(self) -> ResidencyMode:
        """Return the residency mode, ``RESIDENT`` when none was written."""
        return ResidencyMode.RESIDENT if isinstance(self.residency, UnsetType) else self.residency

    @property
    def is_pinned(self) -> bool:
        """Tell whether it is explicitly resident: never offloaded, never evicted."""
        return self.residency is ResidencyMode.RESIDENT

    @property
    def layerwise_config(self) -> LayerwiseConfig:
        """Return the block streaming settings, the defaults when none were written."""
        return LayerwiseConfig() if isinstance(self.layerwise, UnsetType) else self.layerwise

    def role_backends(self) -> dict[str, str]:
        """Return the explicit backends by key (``all``, ``self``, ``cross``)."""
        if isinstance(self.attention_backend, UnsetType):
            return {}
        if isinstance(self.attention_backend, str):
            return {ALL_ROLES: self.attention_backend}
        return dict(self.attention_backend)


class StepWindow(_Spec, frozen=True, kw_only=True, forbid_unknown_fields=True, omit_defaults=True):
    """The denoising timesteps at which a stage's component predicts (design §18).

    Attributes:
        from_timestep: it predicts at timesteps at least this high (none: no lower bound).
        below_timestep: it predicts at timesteps below this (none: no upper bound).
    """

    from_timestep: float | None = None
    below_timestep: float | None = None

    def describe(self) -> str:
        """Say the window in one phrase: ``t >= 875``, ``t < 875``, ``500 <= t < 875``."""
        low, high = self.from_timestep, self.below_timestep
        if low is not None and high is not None:
            return f"{low:g} <= t < {high:g}"
        if low is not None:
            return f"t >= {low:g}"
        return "any t" if high is None else f"t < {high:g}"


class StageSpec(_Spec, frozen=True, kw_only=True, forbid_unknown_fields=True, omit_defaults=True):
    """One stage of a request, and the components it uses, in order.

    Attributes:
        name: the stage's name, unique in the pipeline.
        uses: the components the stage needs resident.
        windows: the uses that predict only at some steps, each with its window (Wan 2.2
            A14B's two experts): the stage holds one of them at a time, the first in
            ``uses`` order on entry, and hands over to the next when the denoiser first
            asks for it.
    """

    name: Annotated[str, msgspec.Meta(min_length=1)]
    uses: Annotated[tuple[str, ...], msgspec.Meta(min_length=1)]
    windows: dict[str, StepWindow] = msgspec.field(default_factory=dict)

    def held_together(self) -> tuple[tuple[str, ...], ...]:
        """Return each set of uses the stage holds at once, in the order it holds them:
        every use, or, with windows, the uses without one plus each windowed use in turn."""
        if not self.windows:
            return (self.uses,)
        rest = tuple(name for name in self.uses if name not in self.windows)
        return tuple((*rest, name) for name in self.uses if name in self.windows)

    def describe(self) -> str:
        """Say the stage in one phrase: ``denoise [transformer (t >= 875), transformer_2
        (t < 875)]``."""
        uses = (
            name if name not in self.windows else f"{name} ({self.windows[name].describe()})"
            for name in self.uses
        )
        return f"{self.name} [{', '.join(uses)}]"


class AdapterSpec(_Spec, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """One adapter (a LoRA of one component, design §14).

    Attributes:
        path: its safetensors file, in diffusers' (PEFT's) LoRA key layout; a relative
            path is read from the spec file's folder (``source`` is too), and the
            decoded spec holds it absolute.
        component: the component it changes; when absent, the prefix every key of the
            file shares (``transformer.`` in diffusers' pipeline layout).
        scale: the scale a request runs it at when it names it without one.
        mode: ``merged`` (a switch merges it into the weights, keeping the base for an
            exact unmerge) or ``unmerged`` (each row of a batch adds its own low-rank
            delta in the forward; the weights never change).
    """

    path: Annotated[str, msgspec.Meta(min_length=1)]
    component: str | UnsetType = UNSET
    scale: float = 1.0
    mode: AdapterMode = "merged"


class PipelineSpec(_Spec, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """A whole pipeline: its components, their settings and its stages.

    Attributes:
        name: the pipeline's name.
        source: the diffusers-format folder the components and stages come from
            (``lifecycle.spec.sources``; absolute once decoded), or a model id
            ``ORG/NAME[@REVISION]`` in the Hugging Face cache (pinned at its commit once
            decoded), or unset.
        source_download: whether a ``source`` model id the cache lacks is downloaded.
        variant: the variant weight files (``fp16``, ``bf16``) every component of the
            ``source`` folder reads unless its ``options.variant`` says another; unset
            reads the files without a variant.
        device: where it runs; ``auto`` picks CUDA when present.
        dtype: the dtype of every component's floating weights that sets none;
            ``float32`` when absent.
        attention: pipeline-wide attention settings.
        parallel: the parallel layout.
        memory: the memory budget and offload target.
        serving: queueing and batching for ``lifecycle serve``.
        components: the components by name (at least one, unless from a folder that
            refuses every one).
        stages: the stages of a request, in timeline order.
        adapters: the adapters (LoRA) by name.
        acceleration: ``auto`` tunes, before the pipeline serves, the ``compile`` and
            ``quantization`` its components leave unset (``lifecycle.autotune``, design
            §17); ``off`` (the default) leaves them off.
        acceleration_min_psnr: the PSNR (dB) of the output against the untuned pipeline's
            that a tuned choice must keep.
    """

    name: Annotated[str, msgspec.Meta(min_length=1)]
    components: dict[str, ComponentSpec]
    source: str | UnsetType = UNSET
    source_download: bool | UnsetType = UNSET
    variant: Variant | UnsetType = UNSET
    device: Device = "auto"
    dtype: DType | UnsetType = UNSET
    attention: AttentionConfig = msgspec.field(default_factory=AttentionConfig)
    parallel: ParallelLayout = msgspec.field(default_factory=ParallelLayout)
    memory: MemoryConfig = msgspec.field(default_factory=MemoryConfig)
    serving: ServingConfig = msgspec.field(default_factory=ServingConfig)
    stages: tuple[StageSpec, ...] = ()
    adapters: dict[str, AdapterSpec] = msgspec.field(default_factory=dict)
    acceleration: Acceleration = "off"
    acceleration_min_psnr: Annotated[float, msgspec.Meta(gt=0)] = 40.0

    def dtype_of(self, name: str) -> DType:
        """Return the dtype of component ``name``: its own, else the pipeline's, else float32."""
        own = self.components[name].dtype
        if not isinstance(own, UnsetType):
            return own
        return "float32" if isinstance(self.dtype, UnsetType) else self.dtype


class WorkerSettings(_Spec, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The ``[worker]`` table of a worker file (``lifecycle serve --worker FILE``).

    Attributes:
        device_budget: the most bytes resident at once for every pipeline the worker
            serves, together (it replaces each spec's ``memory.device_budget``).
    """

    device_budget: ByteSize | UnsetType = UNSET


class WorkerFile(_Spec, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """A worker file: settings of a worker serving several pipelines (design §13).

    Attributes:
        worker: the worker's settings.
    """

    worker: WorkerSettings = msgspec.field(default_factory=WorkerSettings)
