"""Refuse a residency nothing would honour: an undeclared use, layerwise offload without blocks."""

from __future__ import annotations

from components import ResidencyMode
from components.loader import ComponentLoader
from components.offload.layerwise_limits import layerwise_problems
from lifecycle.config import ComponentSpec
from lifecycle.refusals import Refusal, RefusalCode


def residency_refusals(
    name: str, component: ComponentSpec, loader: ComponentLoader, used: bool
) -> list[Refusal]:
    mode = component.residency_mode
    found = []
    if mode is ResidencyMode.LAYERWISE_OFFLOAD:
        found += _layerwise_refusals(name, component, loader)
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
    name: str, component: ComponentSpec, loader: ComponentLoader
) -> list[Refusal]:
    blocks = loader.block_count()
    if loader.block_stack is None or blocks is None:
        return [
            Refusal(
                code=RefusalCode.NOT_OFFLOADABLE,
                component=name,
                message=f"component '{name}' asks for layerwise_offload, but kind "
                f"'{component.kind}' declares no block stack to stream",
                hint=f'use residency = "component_offload" for {name}',
            )
        ]
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
