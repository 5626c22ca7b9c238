"""The pipeline spec: frozen msgspec Structs decoded from TOML, JSON or YAML.

A key's presence is what makes a choice *explicit*: optional choices default
to ``UNSET``, and the ``*_is_explicit`` / effective-value helpers tell the two
apart. Everything wrong with one file is a ``ConfigError`` that names the key
path, what was expected and what was found; anything that involves several
keys or the platform is left to admission, which refuses.
"""

from __future__ import annotations

import json
import re
import tomllib
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar

import msgspec
import yaml
from msgspec import UNSET, UnsetType

from attention import AttentionRole, registry
from components import OffloadTarget, OffloadVerify, ParallelLayout, ResidencyMode
from components import registry as kinds
from components.cache import CacheSettings
from components.dtypes import DType
from components.loader import ComponentLoader
from lifecycle.sizes import SIZE_PATTERN, ByteSize
from lifecycle.sources import SOURCE, SourceError, resolve_source

Loader = Literal["custom", "native"]
AdapterMode = Literal["merged", "unmerged"]
Device = Literal["cpu", "cuda", "auto"]
StatusPage = Literal["open", "private"]
ALL_ROLES = "all"
_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_-]*$")
_T = TypeVar("_T")
MAX_SPEC_BYTES = 1024 * 1024
MAX_SPEC_DEPTH = 32
MAX_SPEC_VALUES = 100_000
_TOO_DEEP = f"the spec is nested deeper than {MAX_SPEC_DEPTH} levels; a pipeline spec needs a few"
_TOO_LARGE = (
    f"the spec is larger than {MAX_SPEC_BYTES // 1024} KiB; a pipeline spec is a few dozen "
    "lines: is this the right file?"
)
_YAML_MERGE = "tag:yaml.org,2002:merge"
DEFAULT_OFFLOAD_DIR = ".lifecycle/offload"


class ConfigError(ValueError):
    """The spec cannot be decoded: one key is wrong, and this says which and how.

    Attributes:
        path: the key path, like ``$.components.vae.residency``.
        message: what was expected and what was found.
        source: the file the spec came from, if any.
    """

    def __init__(self, message: str, path: str = "$", source: str | None = None) -> None:
        self.message = message
        self.path = path
        self.source = source
        # "at `$`" names no key: a file or syntax error stands alone
        super().__init__(message if path == "$" else f"{message} - at `{path}`")


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
            ``lifecycle.serving.priorities``.
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
        options: the kind's own options, validated by the kind.
    """

    kind: Annotated[str, msgspec.Meta(min_length=1)]
    residency: ResidencyMode | UnsetType = UNSET
    attention_backend: str | dict[str, str] | UnsetType = UNSET
    loader: Loader | UnsetType = UNSET
    layerwise: LayerwiseConfig | UnsetType = UNSET
    dtype: DType | UnsetType = UNSET
    cache: CacheSettings | UnsetType = UNSET
    options: dict[str, Any] = msgspec.field(default_factory=dict)

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


class StageSpec(_Spec, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """One stage of a request, and the components it uses, in order.

    Attributes:
        name: the stage's name, unique in the pipeline.
        uses: the components the stage needs resident.
    """

    name: Annotated[str, msgspec.Meta(min_length=1)]
    uses: Annotated[tuple[str, ...], msgspec.Meta(min_length=1)]


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
            (``lifecycle.sources``; absolute once decoded), or unset.
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
    """

    name: Annotated[str, msgspec.Meta(min_length=1)]
    components: dict[str, ComponentSpec]
    source: str | UnsetType = UNSET
    device: Device = "auto"
    dtype: DType | UnsetType = UNSET
    attention: AttentionConfig = msgspec.field(default_factory=AttentionConfig)
    parallel: ParallelLayout = msgspec.field(default_factory=ParallelLayout)
    memory: MemoryConfig = msgspec.field(default_factory=MemoryConfig)
    serving: ServingConfig = msgspec.field(default_factory=ServingConfig)
    stages: tuple[StageSpec, ...] = ()
    adapters: dict[str, AdapterSpec] = msgspec.field(default_factory=dict)

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


def load_spec(path: str | Path) -> PipelineSpec:
    """Read and decode the spec at ``path``; the format follows its extension.

    A folder is read as the spec ``source = "path"``: the pipeline a diffusers-format
    folder holds, with nothing overridden.

    Raises:
        ConfigError: the file is missing or unreadable, or the spec (or its folder) is bad.
    """
    source = str(path)
    try:
        if Path(path).is_dir():
            return _decoded({SOURCE: source}, Path())
        text, fmt, _ = _read(path, "spec")
        return decode_spec(text, fmt, Path(path).parent)
    except ConfigError as err:
        raise ConfigError(err.message, err.path, source) from None


def load_worker_file(path: str | Path) -> WorkerFile:
    """Read and decode the worker file at ``path``; the format follows its extension.

    Raises:
        ConfigError: the file is missing or unreadable, or a key is bad.
    """
    text, fmt, source = _read(path, "worker file")
    try:
        raw = _parse(text, fmt)
        _check_shape(raw)
        return _convert(raw, WorkerFile, "$")
    except ConfigError as err:
        raise ConfigError(err.message, err.path, source) from None


def _read(path: str | Path, what: str) -> tuple[str, str, str]:
    """Return the text of the file at ``path``, its format (extension) and its name.

    Raises:
        ConfigError: the file is missing, unreadable, too large or not UTF-8.
    """
    source = str(path)
    try:
        with Path(path).open("rb") as file:
            data = file.read(MAX_SPEC_BYTES + 1)
        if len(data) > MAX_SPEC_BYTES:
            raise ConfigError(_TOO_LARGE, source=source)
        text = data.decode("utf-8")
    except OSError as err:
        raise ConfigError(f"cannot read the {what}: {err.strerror}", source=source) from None
    except UnicodeDecodeError:
        raise ConfigError(f"the {what} is not UTF-8 text", source=source) from None
    return text, Path(path).suffix.lstrip(".").lower(), source


def decode_spec(text: str, fmt: str = "toml", base: Path | None = None) -> PipelineSpec:
    """Decode the spec in ``text`` written in ``fmt`` (toml, json, yaml or yml).

    A ``source`` folder and the adapters' files are read relative to ``base`` (the spec
    file's folder; the working directory when None).

    Raises:
        ConfigError: bad syntax, unknown keys, wrong types or values, unknown
            backend names, a stage naming an undeclared component, a ``source``
            folder that is missing, malformed, or does not have what the spec names, or
            an adapter file that is not there.
    """
    if len(text.encode("utf-8", "surrogatepass")) > MAX_SPEC_BYTES:
        raise ConfigError(_TOO_LARGE)
    raw = _parse(text, fmt)
    _check_shape(raw)
    return _decoded(raw, base or Path())


def _decoded(raw: object, base: Path) -> PipelineSpec:
    """Decode a parsed spec, its ``source`` folder and adapter files (read relative to
    ``base``) resolved."""
    if isinstance(raw, dict) and SOURCE in raw:
        try:
            raw = resolve_source(raw, base)
        except SourceError as err:
            raise ConfigError(err.message, err.path) from None
    # msgspec writes a dict key as `[...]` in its error paths; converting each
    # component on its own lets the error name the component.
    if isinstance(raw, dict) and isinstance(raw.get("components"), dict):
        for name, component in raw["components"].items():
            _convert(component, ComponentSpec, f"$.components.{name}")
    spec = _convert(raw, PipelineSpec, "$")
    _check(spec)
    return _with_adapter_files(_with_option_files(spec, base), base)


def adapter_file(path: str, base: Path) -> str:
    """Return the adapter file ``path``, read relative to ``base`` when relative, absolute.

    Raises:
        ValueError: no file is there; the message names ``path`` as given and as read.
    """
    found = (base / path).resolve()
    if not found.is_file():
        what = f"{found} is a folder" if found.is_dir() else f"no file at {found}"
        raise ValueError(f"Expected a LoRA safetensors file, got {path!r}: {what}")
    return str(found)


def _with_option_files(spec: PipelineSpec, base: Path) -> PipelineSpec:
    """Return ``spec`` with each component's file options (``weights``, a tokenizer...)
    read relative to ``base`` when relative: whether they exist is admission's to say."""
    components = {}
    for name, component in spec.components.items():
        files = kinds.get(component.kind).options_type.files
        found = {
            key: str(base / value)
            for key in files
            if isinstance(value := component.options.get(key), str)
        }
        if found:
            options = {**component.options, **found}
            components[name] = msgspec.structs.replace(component, options=options)
    if not components:
        return spec
    return msgspec.structs.replace(spec, components={**spec.components, **components})


def _with_adapter_files(spec: PipelineSpec, base: Path) -> PipelineSpec:
    """Return ``spec`` with each adapter's file read relative to ``base``, absolute."""
    adapters = {}
    for name, adapter in spec.adapters.items():
        try:
            path = adapter_file(adapter.path, base)
        except ValueError as err:
            raise ConfigError(
                f"{err}; a relative path is read from the spec file's folder",
                f"$.adapters.{name}.path",
            ) from None
        adapters[name] = msgspec.structs.replace(adapter, path=path)
    return msgspec.structs.replace(spec, adapters=adapters) if adapters else spec


def spec_schema() -> dict[str, Any]:
    """Return the JSON Schema of the spec."""
    return msgspec.json.schema(PipelineSpec, schema_hook=_schema_hook)


def _parse(text: str, fmt: str) -> object:
    try:
        if fmt == "toml":
            return tomllib.loads(text)
        if fmt == "json":
            return json.loads(text, object_pairs_hook=_unique_json_object)
        if fmt in ("yaml", "yml"):
            return yaml.load(text, Loader=_UniqueKeyYamlLoader)
    except ConfigError:
        raise
    except tomllib.TOMLDecodeError as err:
        raise ConfigError(f"invalid TOML: {err}") from None
    except json.JSONDecodeError as err:
        raise ConfigError(f"invalid JSON: {err}") from None
    except yaml.YAMLError as err:
        raise ConfigError(f"invalid YAML: {' '.join(str(err).split())}") from None
    except RecursionError:
        raise ConfigError(_TOO_DEEP) from None
    except ValueError as err:  # e.g. an integer of more digits than Python converts
        raise ConfigError(f"invalid {fmt.upper()}: {err}") from None
    raise ConfigError(f"Expected a .toml, .json, .yaml or .yml spec, got {fmt!r}")


def _check_shape(raw: object) -> None:
    """Refuse a parsed spec nested deeper, or holding more values, than any spec needs.

    Counting values also bounds YAML aliases, which can make a small file a huge tree.
    """
    pending: list[tuple[object, int]] = [(raw, 1)]
    values = 0
    while pending:
        value, depth = pending.pop()
        values += 1
        if depth > MAX_SPEC_DEPTH:
            raise ConfigError(_TOO_DEEP)
        if values > MAX_SPEC_VALUES:
            raise ConfigError(
                f"the spec holds more than {MAX_SPEC_VALUES} values (YAML aliases count each "
                "time they are used); a pipeline spec needs far fewer"
            )
        if isinstance(value, dict):
            pending.extend((item, depth + 1) for item in value.values())
        elif isinstance(value, list | tuple):
            pending.extend((item, depth + 1) for item in value)


def _unique_json_object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    seen: dict[str, Any] = {}
    for key, value in pairs:
        if key in seen:
            raise ConfigError(f"invalid JSON: the key {key!r} appears twice in one object")
        seen[key] = value
    return seen


# libyaml's parser when PyYAML was built with it: five times faster than the Python one
_YamlBase: type[yaml.SafeLoader] = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


class _UniqueKeyYamlLoader(_YamlBase):  # type: ignore[valid-type,misc]
    """A SafeLoader that refuses a key written twice in one mapping.

    Merge keys (``<<: *base``) are allowed, and a key written beside them replaces the
    merged one, as YAML says; only keys written twice by hand are refused.
    """

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            if key_node.tag == _YAML_MERGE:
                continue
            key = self.construct_object(key_node, deep=deep)
            try:
                duplicate = key in seen
            except TypeError:  # unhashable: the base class refuses it with a YAMLError
                continue
            if duplicate:
                raise ConfigError(f"invalid YAML: the key {key!r} appears twice in one mapping")
            seen.add(key)
        mapping: dict[Any, Any] = super().construct_mapping(node, deep=deep)
        return mapping


def _convert(raw: object, type_: type[_T], at: str) -> _T:
    with _decoding_at(at):
        return msgspec.convert(raw, type_, dec_hook=_dec_hook)


@contextmanager
def _decoding_at(at: str) -> Iterator[None]:
    """Turn a msgspec validation error inside into a ConfigError at its full key path."""
    try:
        yield
    except msgspec.ValidationError as err:
        message, _, path = str(err).partition(" - at `")
        path = at + path.rstrip("`").removeprefix("$") if path else at
        raise ConfigError(_explain(message, path), path) from None


def _dec_hook(type_: type, value: object) -> object:
    if type_ is ByteSize:
        return ByteSize.parse(value)
    raise NotImplementedError(f"no decoder for {type_!r}")


def _schema_hook(type_: type) -> dict[str, Any]:
    if type_ is ByteSize:
        return {
            "anyOf": [
                {"type": "integer", "minimum": 0},
                {"type": "string", "pattern": SIZE_PATTERN},
            ]
        }
    raise NotImplementedError(f"no schema for {type_!r}")


_INVALID_ENUM = re.compile(r"^Invalid enum value (.+)$")


def _explain(message: str, path: str) -> str:
    """Rewrite msgspec's "Invalid enum value" as expected-vs-found."""
    match = _INVALID_ENUM.match(message)
    if match is None:
        return message
    choices = _choices_at(path)
    found = match.group(1)
    return f"Expected `{' | '.join(choices)}`, got {found}" if choices else message


def _choices_at(path: str) -> tuple[str, ...]:
    info: msgspec.inspect.Type = msgspec.inspect.type_info(PipelineSpec)
    for segment in re.findall(r"\.([^.\[]+)|\[[^\]]*\]", path.removeprefix("$")):
        info = _step(info, segment)
    return tuple(str(v) for v in _enum_values(info))


def _step(info: msgspec.inspect.Type, segment: str) -> msgspec.inspect.Type:
    for candidate in _members(info):
        if isinstance(candidate, msgspec.inspect.StructType):
            fields = {f.encode_name: f.type for f in candidate.fields}
            if segment in fields:
                return fields[segment]
        if isinstance(candidate, msgspec.inspect.DictType):
            return candidate.value_type
        if isinstance(candidate, msgspec.inspect.VarTupleType | msgspec.inspect.ListType):
            return candidate.item_type
    return msgspec.inspect.AnyType()


def _members(info: msgspec.inspect.Type) -> tuple[msgspec.inspect.Type, ...]:
    if isinstance(info, msgspec.inspect.UnionType):
        return info.types
    return (info,)


def _enum_values(info: msgspec.inspect.Type) -> list[object]:
    values: list[object] = []
    for member in _members(info):
        if isinstance(member, msgspec.inspect.EnumType):
            values.extend(e.value for e in member.cls)
        if isinstance(member, msgspec.inspect.LiteralType):
            values.extend(member.values)
    return values


def _check(spec: PipelineSpec) -> None:
    """Check what the types cannot say; raise ConfigError at the first problem."""
    if not spec.components and isinstance(spec.source, UnsetType):
        raise ConfigError(
            "Expected at least one component, got none: add a [components.NAME] table, or "
            'name a pipeline folder with source = "path"',
            "$.components",
        )
    _check_memory(spec)
    _check_attention(spec)
    _check_components(spec)
    _check_names(spec.components, sorted(spec.parallel.fsdp), "$.parallel.fsdp")
    _check_stages(spec)
    _check_adapters(spec)


def _check_memory(spec: PipelineSpec) -> None:
    offload_dir = spec.memory.offload_dir
    if not offload_dir.strip():  # Path("") is the working directory
        raise ConfigError(
            f"Expected a folder, got {offload_dir!r}, which would put the disk offload files "
            f"in the working directory: name a folder, or leave the key out for "
            f"{DEFAULT_OFFLOAD_DIR}",
            "$.memory.offload_dir",
        )


def _check_backend(name: str, path: str) -> None:
    known = registry.names()
    if name not in known:
        raise ConfigError(
            f"Expected a known attention backend ({', '.join(known)}), got {name!r}", path
        )


def _check_attention(spec: PipelineSpec) -> None:
    if not isinstance(spec.attention.backend, UnsetType):
        _check_backend(spec.attention.backend, "$.attention.backend")
    for backend, options in spec.attention.backend_options.items():
        at = f"$.attention.backend_options.{backend}"
        _check_backend(backend, at)
        with _decoding_at(at):
            registry.decode_options(backend, options)


def _check_components(spec: PipelineSpec) -> None:
    role_keys = (ALL_ROLES, *(role.value for role in AttentionRole))
    for name, component in spec.components.items():
        at = f"$.components.{name}"
        if not _NAME.match(name):
            raise ConfigError(
                "Expected a component name of letters, digits, '_' or '-' that starts "
                f"with a letter or '_', got {name!r}",
                at,
            )
        loader = _kind(component.kind, f"{at}.kind")
        _convert(component.options, loader.options_type, f"{at}.options")
        layerwise = ResidencyMode.LAYERWISE_OFFLOAD
        if not isinstance(component.layerwise, UnsetType) and component.residency != layerwise:
            raise ConfigError(
                f'Expected residency = "{layerwise.value}" beside a layerwise table, got '
                f'residency = "{component.residency_mode.value}"',
                f"{at}.layerwise",
            )
        table = component.attention_backend
        if isinstance(table, str):
            _check_backend(table, f"{at}.attention_backend")
            continue
        if isinstance(table, dict) and not table:
            raise ConfigError(
                f"Expected a backend name or a table with any of {', '.join(role_keys)}, "
                "got an empty table",
                f"{at}.attention_backend",
            )
        for key, backend in component.role_backends().items():
            key_at = f"{at}.attention_backend.{key}"
            if key not in role_keys:
                raise ConfigError(f"Expected `{' | '.join(role_keys)}`, got {key!r}", key_at)
            _check_backend(backend, key_at)


def _kind(name: str, at: str) -> type[ComponentLoader]:
    try:
        return kinds.get(name)
    except kinds.UnknownKindError as err:
        raise ConfigError(
            f"Expected an installed component kind ({', '.join(err.known)}), got {name!r}"
            f"{err.broken}; {err.fix}",
            at,
        ) from None


def _check_stages(spec: PipelineSpec) -> None:
    first_at: dict[str, int] = {}
    for index, stage in enumerate(spec.stages):
        at = f"$.stages[{index}]"
        if stage.name in first_at:
            raise ConfigError(
                f"Expected a unique stage name, got {stage.name!r} again "
                f"(first at $.stages[{first_at[stage.name]}])",
                f"{at}.name",
            )
        first_at[stage.name] = index
        _check_names(spec.components, stage.uses, f"{at}.uses")
        for position, use in enumerate(stage.uses):
            if stage.uses.index(use) != position:
                raise ConfigError(
                    f"Expected each component once per stage, got {use!r} twice",
                    f"{at}.uses[{position}]",
                )


def _check_adapters(spec: PipelineSpec) -> None:
    for name, adapter in spec.adapters.items():
        at = f"$.adapters.{name}"
        if not _NAME.match(name) or name in spec.components:
            raise ConfigError(
                "Expected an adapter name of letters, digits, '_' or '-' that starts with a "
                f"letter or '_' and names no component, got {name!r}",
                at,
            )
        component = adapter.component
        if not isinstance(component, UnsetType) and component not in spec.components:
            raise ConfigError(
                f"Expected a declared component ({', '.join(spec.components)}), got {component!r}",
                f"{at}.component",
            )


def _check_names(components: Mapping[str, ComponentSpec], names: Sequence[str], at: str) -> None:
    for position, name in enumerate(names):
        if name not in components:
            raise ConfigError(
                f"Expected a declared component ({', '.join(components)}), got {name!r}",
                f"{at}[{position}]",
            )
