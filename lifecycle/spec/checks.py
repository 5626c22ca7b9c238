"""What the spec's types cannot say about one file: names, kinds, backends, stages, adapters.

Each check raises ``ConfigError`` at the first problem, at its key path; anything that
involves the platform is left to admission.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence

from msgspec import UnsetType

from attention import AttentionRole, registry
from components import ResidencyMode
from components import registry as kinds
from components.loader import ComponentLoader
from lifecycle.spec.errors import ConfigError, convert, decoding_at
from lifecycle.spec.structs import ALL_ROLES, DEFAULT_OFFLOAD_DIR, ComponentSpec, PipelineSpec

__all__ = ["NAME_PATTERN", "check_spec"]

NAME_PATTERN = r"^[A-Za-z_][A-Za-z0-9_-]*$"
"""What a component, stage or adapter may be called: letters, digits, '_' and '-',
starting with a letter or '_'."""
_NAME = re.compile(NAME_PATTERN)


def check_spec(spec: PipelineSpec) -> None:
    """Check what the types cannot say; raise ConfigError at the first problem."""
    if not spec.components and isinstance(spec.source, UnsetType):
        raise ConfigError(
            "Expected at least one component, got none: add a [components.NAME] table, or "
            'name a pipeline folder with source = "path"',
            "$.components",
        )
    if isinstance(spec.source, UnsetType) and not isinstance(spec.variant, UnsetType):
        raise ConfigError(
            "Expected no variant without source: it picks the weight files of a pipeline "
            "folder's components; name the folder with source, or set a folder component's "
            "own in [components.NAME.options]",
            "$.variant",
        )
    if isinstance(spec.source, UnsetType) and spec.source_download is True:
        raise ConfigError(
            "Expected no source_download without source: it lets a source model id be "
            "downloaded; name one with source, or drop the key",
            "$.source_download",
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
        with decoding_at(at):
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
        convert(component.options, loader.options_type, f"{at}.options")
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
        for name in stage.windows:
            if name not in stage.uses:
                raise ConfigError(
                    f"Expected a step window of one of the stage's uses "
                    f"({', '.join(stage.uses)}), got {name!r}",
                    f"{at}.windows.{name}",
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
