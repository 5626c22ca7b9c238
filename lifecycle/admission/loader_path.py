"""Choose a component's loading path, and refuse a native path for what it cannot honour."""

from __future__ import annotations

from msgspec import UnsetType

from components.loader import ComponentLoader, LoaderPath
from lifecycle.refusals import Refusal, RefusalCode
from lifecycle.spec.structs import ALL_ROLES, ComponentSpec, PipelineSpec

__all__ = ["choose_path", "native_backend_refusals", "native_layout_refusals"]


def choose_path(
    name: str, component: ComponentSpec, loader: ComponentLoader, found: list[Refusal]
) -> LoaderPath | None:
    if not isinstance(component.loader, UnsetType):
        reason = loader.unavailable_reason(component.loader)
        if reason is None:
            return component.loader
        found.append(
            Refusal(
                code=RefusalCode.LOADER_UNAVAILABLE,
                component=name,
                message=f"loader = '{component.loader}' was asked for, but {reason}",
                hint=f"remove components.{name}.loader to let the kind choose, or "
                "install what the path needs",
            )
        )
        return None
    custom_reason = loader.unavailable_reason("custom")
    if custom_reason is None:
        return "custom"
    native_reason = loader.unavailable_reason("native")
    if native_reason is None:
        return "native"
    found.append(
        Refusal(
            code=RefusalCode.LOADER_UNAVAILABLE,
            component=name,
            message=f"no loading path can build kind '{component.kind}' here: "
            f"{custom_reason}; {native_reason}",
            hint="register a kind with a custom or native path, or install what it needs",
        )
    )
    return None


def native_layout_refusals(
    name: str, component: ComponentSpec, spec: PipelineSpec, loader: ComponentLoader
) -> list[Refusal]:
    """Refuse a native path for a layout that splits the model (tp, sp, ..., FSDP)."""
    asked = spec.parallel.splits(name)
    if not asked:
        return []
    why = (
        ""
        if isinstance(component.loader, str)
        else f" (its custom path is unavailable: {loader.unavailable_reason('custom')})"
    )
    return [
        Refusal(
            code=RefusalCode.NATIVE_PARALLEL_LAYOUT,
            component=name,
            message=f"component '{name}' would load natively{why}, and a native path "
            f"cannot honour the parallel layout ({', '.join(asked)})",
            hint="use a kind with a custom path for this layout, or drop the layout to "
            "data or CFG parallel (replicated layouts work natively)",
        )
    ]


def native_backend_refusals(name: str, component: ComponentSpec) -> list[Refusal]:
    """Refuse a native path for a component with explicit attention backends."""
    return [
        Refusal(
            code=RefusalCode.NATIVE_EXPLICIT_BACKEND,
            component=name,
            message=f"backend '{backend}' was requested for component '{name}' "
            f"({'component-wide' if key == ALL_ROLES else key + '-attention'}), but it "
            "loads through a native path, which does not use the attention package",
            hint=f'remove components.{name}.attention_backend, or load it with loader = "custom"',
        )
        for key, backend in component.role_backends().items()
    ]
