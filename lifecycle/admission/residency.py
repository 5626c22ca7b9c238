"""Refuse a residency nothing would honour: an undeclared use, layerwise offload without blocks."""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from components import ResidencyMode
from components.loader import ComponentLoader
from components.offload import OffloadError
from components.offload.layerwise_limits import layerwise_problems
from components.random_fills import built_on_meta
from lifecycle.refusals import Refusal, RefusalCode
from lifecycle.spec.structs import ComponentSpec

__all__ = ["residency_refusals"]

ModuleBuilder = Callable[[], nn.Module]
"""Constructs a component's module through its admitted path, without weights."""


def residency_refusals(
    name: str,
    component: ComponentSpec,
    loader: ComponentLoader,
    used: bool,
    construct: ModuleBuilder | None,
) -> list[Refusal]:
    """Refuse the component's residency when nothing would honour it.

    ``construct`` builds the module on its admitted path (None: no path was admitted);
    a layerwise component's block stack is looked for on what it builds on the meta
    device, which allocates and reads nothing.
    """
    mode = component.residency_mode
    found = []
    if mode is ResidencyMode.LAYERWISE_OFFLOAD:
        found += _layerwise_refusals(name, component, loader, construct)
    if not used and mode is not ResidencyMode.RESIDENT:
        found.append(
            Refusal(
                code=RefusalCode.UNDECLARED_USE,
                component=name,
                message=f"component '{name}' is explicitly {mode.value}, but no stage uses "
                "it, so nothing would ever onload it",
                hint=f"add '{name}' to the uses of the stage that needs it, or remove "
                f"components.{name}.residency",
            )
        )
    return found


def _layerwise_refusals(
    name: str, component: ComponentSpec, loader: ComponentLoader, construct: ModuleBuilder | None
) -> list[Refusal]:
    blocks = loader.block_count()
    if loader.block_stack is None or blocks is None:
        why = f"kind '{component.kind}' declares no block stack"
        if loader.unstreamable is not None:
            why += f": {loader.unstreamable}"
        return [_not_streamable(name, component, why)]
    problem = None if construct is None else _stack_problem(construct, loader)
    if problem is not None:
        return [_not_streamable(name, component, problem)]
    config = component.layerwise_config
    problems = layerwise_problems(
        blocks, prefetch=config.prefetch, resident_layers=config.resident_layers
    )
    return (
        [
            Refusal(
                code=RefusalCode.INVALID_LAYERWISE,
                component=name,
                message=f"component '{name}' streams {blocks} block{'s' if blocks != 1 else ''} "
                f"(kind '{component.kind}'), and its layerwise settings cannot be honoured: "
                f"{'; '.join(problems)}",
                hint=f"change [components.{name}.layerwise] to fit {blocks} "
                f"block{'s' if blocks != 1 else ''}",
            )
        ]
        if problems
        else []
    )


def _stack_problem(construct: ModuleBuilder, loader: ComponentLoader) -> str | None:
    """Say why the module built on the meta device has no block stack to stream, if so."""
    try:
        module = built_on_meta(construct)
    except Exception as err:  # a kind's own code: whatever it raises is the reason
        return (
            f"building kind '{loader.kind}' on the meta device to find its block stack failed "
            f"({type(err).__name__}: {err})"
        )
    try:
        loader.blocks(module)
    except OffloadError as err:
        return str(err)
    return None


def _not_streamable(name: str, component: ComponentSpec, why: str) -> Refusal:
    return Refusal(
        code=RefusalCode.NOT_OFFLOADABLE,
        component=name,
        message=f"component '{name}' asks for layerwise_offload, but {why}",
        hint=f'use residency = "component_offload" for {name}',
    )
