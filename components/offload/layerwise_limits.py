"""What layerwise offload can stream, and what its settings can honour: one check each
for admission and the store."""

from __future__ import annotations

from torch import nn

from components.offload.base import OffloadError


def find_block_stack(module: nn.Module, attribute: str, kind: str) -> nn.ModuleList:
    """Return the ``nn.ModuleList`` at ``attribute`` of ``module``, the blocks that stream.

    Admission calls this on the module built on the meta device, and the orchestrator
    on the loaded one, so an explicit layerwise offload is never silently whole.

    Raises:
        OffloadError: there is no ``nn.ModuleList`` there (the message says what is).
    """
    found = getattr(module, attribute, None)
    if isinstance(found, nn.ModuleList):
        return found
    what = (
        f"builds no attribute '{attribute}' for its block stack"
        if found is None
        else f"builds its block stack '{attribute}' as a {type(found).__name__}, "
        "not an nn.ModuleList"
    )
    raise OffloadError(
        f"kind '{kind}' {what}: layerwise offload streams the blocks of an nn.ModuleList; "
        "make it one, or use component_offload"
    )


def layerwise_problems(blocks: int, *, prefetch: int, resident_layers: int) -> list[str]:
    """Say which layerwise setting a stack of ``blocks`` blocks cannot honour, if any.

    Admission calls this with the block count a kind declares from its options, and
    ``LayerwiseStore`` with the stack it was handed, so the two never disagree.
    """
    problems = []
    if prefetch < 0:
        problems.append(f"prefetch is {prefetch}; use 0 or more blocks")
    if not 0 <= resident_layers <= blocks:
        problems.append(f"resident_layers is {resident_layers}; use 0 to {blocks}")
    return problems
