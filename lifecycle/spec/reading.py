"""Read a spec or worker file within bounds, parse it, and decode it into the Structs.

A file is read at most ``MAX_SPEC_BYTES``; a parsed spec may be nested at most
``MAX_SPEC_DEPTH`` levels and hold at most ``MAX_SPEC_VALUES`` values (YAML aliases
count each time they are used); a key written twice in one table is refused.
"""

from __future__ import annotations

import json
import tomllib
from pathlib import Path
from typing import Any

import msgspec
import yaml

from components import registry as kinds
from lifecycle.shown import shown
from lifecycle.spec.checks import check_spec
from lifecycle.spec.errors import ConfigError, convert
from lifecycle.spec.model_ids import parse_model_id
from lifecycle.spec.sizes import SIZE_PATTERN, ByteSize
from lifecycle.spec.sources import SOURCE, SourceError, resolve_source
from lifecycle.spec.structs import ComponentSpec, PipelineSpec, WorkerFile

__all__ = ["adapter_file", "decode_spec", "load_spec", "load_worker_file", "spec_schema"]

MAX_SPEC_BYTES = 1024 * 1024
MAX_SPEC_DEPTH = 32
MAX_SPEC_VALUES = 100_000
_TOO_DEEP = f"the spec is nested deeper than {MAX_SPEC_DEPTH} levels; a pipeline spec needs a few"
_TOO_LARGE = (
    f"the spec is larger than {MAX_SPEC_BYTES // 1024} KiB; a pipeline spec is a few dozen "
    "lines: is this the right file?"
)
_YAML_MERGE = "tag:yaml.org,2002:merge"


def load_spec(path: str | Path, *, download: bool = False) -> PipelineSpec:
    """Read and decode the spec at ``path``; the format follows its extension.

    A folder is read as the spec ``source = "path"``: the pipeline a diffusers-format
    folder holds, with nothing overridden; so is a model id ``ORG/NAME[@REVISION]`` where
    no file or folder has that name (``lifecycle.spec.model_ids``), which ``download``
    lets be fetched into the Hugging Face cache (also for a spec's ``source``).

    Raises:
        ConfigError: the file is missing or unreadable, the model id is not in the cache,
            or the spec (or its folder) is bad.
    """
    source = str(path)
    try:
        found = Path(path)
        if _lookup_error(found) is None and (
            found.is_dir() or (not found.exists() and parse_model_id(source) is not None)
        ):
            return _decoded({SOURCE: source}, Path(), download)
        text, fmt, _ = _read(path, "spec")
        return decode_spec(text, fmt, Path(path).parent, download=download)
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
        return convert(raw, WorkerFile, "$")
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


def decode_spec(
    text: str, fmt: str = "toml", base: Path | None = None, *, download: bool = False
) -> PipelineSpec:
    """Decode the spec in ``text`` written in ``fmt`` (toml, json, yaml or yml).

    A ``source`` folder and the adapters' files are read relative to ``base`` (the spec
    file's folder; the working directory when None); ``download`` lets a ``source`` model
    id be fetched into the Hugging Face cache.

    Raises:
        ConfigError: bad syntax, unknown keys, wrong types or values, unknown
            backend names, a stage naming an undeclared component, a ``source``
            folder that is missing, malformed, or does not have what the spec names (or a
            model id the cache lacks), or an adapter file that is not there.
    """
    if len(text.encode("utf-8", "surrogatepass")) > MAX_SPEC_BYTES:
        raise ConfigError(_TOO_LARGE)
    raw = _parse(text, fmt)
    _check_shape(raw)
    return _decoded(raw, base or Path(), download)


def _decoded(raw: object, base: Path, download: bool = False) -> PipelineSpec:
    """Decode a parsed spec, its ``source`` folder and adapter files (read relative to
    ``base``) resolved; ``download`` lets a model id be fetched."""
    if isinstance(raw, dict) and SOURCE in raw:
        try:
            raw = resolve_source(raw, base, download=download)
        except SourceError as err:
            raise ConfigError(err.message, err.path) from None
    # msgspec writes a dict key as `[...]` in its error paths; converting each
    # component on its own lets the error name the component.
    if isinstance(raw, dict) and isinstance(raw.get("components"), dict):
        for name, component in raw["components"].items():
            convert(component, ComponentSpec, f"$.components.{name}")
    spec = convert(raw, PipelineSpec, "$")
    check_spec(spec)
    return _with_adapter_files(_with_option_files(spec, base), base)


def adapter_file(path: str, base: Path) -> str:
    """Return the adapter file ``path``, read relative to ``base`` when relative, absolute.

    Raises:
        ValueError: no file is there; the message names ``path`` as given and as read.
    """
    found = (base / path).resolve()
    refused = _lookup_error(found)
    if refused is not None:
        raise ValueError(f"Expected a LoRA safetensors file, got {path!r}: {refused}")
    if not found.is_file():
        what = f"{found} is a folder" if found.is_dir() else f"no file at {found}"
        raise ValueError(f"Expected a LoRA safetensors file, got {path!r}: {what}")
    return str(found)


def _lookup_error(path: Path) -> str | None:
    """Say why the file system refuses to look ``path`` up at all (a name longer than it
    allows), or None; whether anything is there is not asked."""
    try:
        path.exists()
    except OSError as err:
        return f"the file system cannot look it up ({err.strerror})"
    return None


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
        for key, path in found.items():
            refused = _lookup_error(Path(path))
            if refused is not None:
                raise ConfigError(
                    f"Expected a path, got {shown(path)}: {refused}",
                    f"$.components.{name}.options.{key}",
                )
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


def _schema_hook(type_: type) -> dict[str, Any]:
    if type_ is ByteSize:
        return {
            "anyOf": [
                {"type": "integer", "minimum": 0},
                {"type": "string", "pattern": SIZE_PATTERN},
            ]
        }
    raise NotImplementedError(f"no schema for {type_!r}")
