"""The memory budget as an admission predicate: pure decisions, no moves.

Onload is guarded: when the resident set would exceed ``memory.device_budget``
the idle evictable components are evicted, the one whose next use in the
request timeline is furthest first; when that cannot free enough, onload is
refused with the numbers.
"""

from __future__ import annotations

from collections.abc import Mapping

import msgspec
from msgspec import UnsetType

from components import ResidencyMode
from components.loader import ComponentLoader
from lifecycle.config import PipelineSpec
from lifecycle.refusals import Refusal, RefusalCode
from lifecycle.sizes import format_sizes


class BudgetDecision(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """What onloading one component takes.

    Attributes:
        victims: the components to evict first, in order (empty when it fits).
        refusal: why it cannot be onloaded at all, or None.
    """

    victims: tuple[str, ...] = ()
    refusal: Refusal | None = None


def fits(used: int, needed: int, budget: int) -> bool:
    """Tell whether ``needed`` more bytes fit a ``budget`` of which ``used`` are taken.

    The one test of "fits": the onload guard, its eviction plan and a prefetch ask it.
    """
    return used + needed <= budget


def plan_onload(
    component: str,
    needed: int,
    budget: int,
    charged: Mapping[str, int],
    used: int,
    evictable: Mapping[str, float],
) -> BudgetDecision:
    """Decide whether ``component`` fits, and whom to evict if it does not.

    Args:
        component: the component to onload.
        needed: the bytes it will hold on the device.
        budget: ``memory.device_budget`` in bytes.
        charged: each other component the budget counts now (on the device, or
            reserved by a prefetch), with its bytes.
        used: their total (the budget keeps it as it goes).
        evictable: each of them that may be evicted now, with the distance to its
            next use (infinite when it has none).
    """
    if fits(used, needed, budget):
        return BudgetDecision()
    victims: list[str] = []
    freed = 0
    for victim in sorted(evictable, key=lambda name: (-evictable[name], name)):
        victims.append(victim)
        freed += charged[victim]
        if fits(used - freed, needed, budget):
            return BudgetDecision(victims=tuple(victims))
    pinned = sorted(set(charged) - set(evictable))
    at_least = used - freed + needed
    needs, free, of, frees, raise_to = format_sizes(
        needed, max(budget - used, 0), budget, freed, at_least
    )
    return BudgetDecision(
        refusal=Refusal(
            code=RefusalCode.MEMORY_BUDGET,
            component=component,
            message=f"onloading '{component}' needs {needs} on device, {free} free of a {of} "
            f"budget, and evicting every idle offloadable component frees only {frees}"
            + (f" ({', '.join(pinned)} cannot be evicted now)" if pinned else ""),
            hint=f"raise memory.device_budget to at least {raise_to}, or give "
            f"{', '.join(pinned) or 'the other components'} an offload residency",
        )
    )


def stage_fits(
    stage: str,
    sizes: Mapping[str, int],
    uses: tuple[str, ...],
    pinned: tuple[str, ...],
    budget: int,
) -> Refusal | None:
    """Check at admission that one stage's components and the pinned ones fit at all."""
    together = dict.fromkeys((*pinned, *uses))
    needed = sum(sizes[name] for name in together)
    if fits(0, needed, budget):
        return None
    total, limit, *each = format_sizes(needed, budget, *(sizes[name] for name in together))
    parts = ", ".join(f"{name} {size}" for name, size in zip(together, each, strict=True))
    return Refusal(
        code=RefusalCode.MEMORY_BUDGET,
        component=uses[0],
        message=f"stage '{stage}' needs {total} on device at once ({parts}), more than the "
        f"{limit} budget",
        hint=f"raise memory.device_budget to at least {total}, or use "
        "layerwise_offload for the largest component of that stage",
    )


def budget_refusals(spec: PipelineSpec, loaders: Mapping[str, ComponentLoader]) -> list[Refusal]:
    """Refuse a pipeline one of whose stages cannot fit the memory budget at all.

    Sizes are declared by the kinds (or read from weights-file headers); a
    component of unknown size, and a layerwise one (whose footprint depends on
    its blocks), is checked when it onloads instead.
    """
    budget = spec.memory.device_budget
    if isinstance(budget, UnsetType):
        return []
    sizes = {
        name: size
        for name, component in spec.components.items()
        if component.residency_mode is not ResidencyMode.LAYERWISE_OFFLOAD
        and (size := declared_bytes(loaders[name])) is not None
    }
    pinned = tuple(
        name for name, component in spec.components.items() if name in sizes and component.is_pinned
    )
    found = []
    for stage in spec.stages:
        uses = tuple(name for name in stage.uses if name in sizes)
        if uses and (refusal := stage_fits(stage.name, sizes, uses, pinned, budget)):
            found.append(refusal)
    # load() onloads a resident component even when no stage uses it
    staged = {name for stage in spec.stages for name in stage.uses}
    for name, component in spec.components.items():
        if (
            name in sizes
            and name not in staged
            and component.residency_mode is ResidencyMode.RESIDENT
            and (refusal := stage_fits("load()", sizes, (name,), pinned, budget))
        ):
            found.append(refusal)
    return found


def declared_bytes(loader: ComponentLoader) -> int | None:
    """Return the declared size, or None when unknown or unreadable (refused elsewhere)."""
    try:
        return loader.declared_bytes()
    except (OSError, ValueError):
        return None  # a missing or broken weights file is the loader path's refusal
