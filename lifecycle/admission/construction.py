"""Construct a component's module the way its path needs: a custom path in its attention scope."""

from __future__ import annotations

from collections.abc import Callable, Mapping

from torch import nn

from attention import ComponentRequests, PlannedSelection, Platform, component_attention_scope
from components.loader import LoaderPath

__all__ = ["construct_module"]


def construct_module(
    path: LoaderPath,
    requests: ComponentRequests,
    planned: Mapping[str, PlannedSelection] | None,
    platform: Platform,
    build: Callable[[], nn.Module],
) -> nn.Module:
    """Run ``build``: on the custom path inside the component's attention scope.

    Its attention layers then take the admitted plan's backends (``planned``); a native
    path builds none of ours. Loading builds this way, and admission on the meta device.
    """
    if path == "native":
        return build()
    with component_attention_scope(requests, plan=planned, platform=platform):
        return build()
