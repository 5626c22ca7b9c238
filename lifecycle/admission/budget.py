"""The memory budget as an admission predicate: pure decisions, no moves.

Onload is guarded: when the resident set would exceed the device budget (a
pipeline's ``memory.device_budget``, or a worker's shared by its pipelines) the idle
evictable components are evicted: first those of the pipeline asked for least
recently, then, within the pipeline being served, the one whose next use in its
request timeline is furthest; when that cannot free enough, onload is refused with
the numbers.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import NamedTuple

import msgspec
from msgspec import UnsetType

from components import ResidencyMode
from components.loader import ComponentLoader
from lifecycle.refusals import Refusal, RefusalCode
from lifecycle.spec.sizes import format_sizes
from lifecycle.spec.structs import PipelineSpec

__all__ = [
    "BudgetDecision",
    "EvictionRank",
    "SharedBudget",
    "budget_refusals",
    "declared_bytes",
    "fits",
    "plan_onload",
    "stage_fits",
]


class SharedBudget(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """A device budget several pipelines share (design §13), as one of them is admitted.

    Attributes:
        limit: the budget in bytes, for every pipeline together.
        key: where it was set (``--device-budget``, ``worker.device_budget``).
        pinned: the components other pipelines keep on the device for good (explicitly
            resident), by ``pipeline/component``, with their declared bytes.
        others: the names of the other pipelines on the device (none: it is alone there).
    """

    limit: int
    key: str
    pinned: dict[str, int] = msgspec.field(default_factory=dict)
    others: tuple[str, ...] = ()


class BudgetDecision(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """What onloading one component takes.

    Attributes:
        victims: the components to evict first, in order (empty when it fits).
        refusal: why it cannot be onloaded at all, or None.
    """

    victims: tuple[str, ...] = ()
    refusal: Refusal | None = None


class EvictionRank(NamedTuple):
    """Where a component stands in the eviction order (design §13): lowest goes first.

    Attributes:
        last_asked: when a request last opened for a pipeline using it (a device-wide
            count; the most recent of its pipelines').
        distance: stages from now to its next use in the pipeline being served
            (infinite when that pipeline has no further use for it).
    """

    last_asked: int
    distance: float


def eviction_order(evictable: Mapping[str, EvictionRank]) -> list[str]:
    """Order ``evictable`` for eviction: least recently asked pipeline first, then furthest
    next use first, then by name (so that the order never depends on the dict's)."""
    return sorted(
        evictable, key=lambda name: (evictable[name].last_asked, -evictable[name].distance, name)
    )


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
    evictable: Mapping[str, EvictionRank],
    budget_key: str = "memory.device_budget",
) -> BudgetDecision:
    """Decide whether ``component`` fits, and whom to evict if it does not.

    Args:
        component: the component to onload.
        needed: the bytes it will hold on the device.
        budget: the device budget in bytes.
        charged: each other component the budget counts now (on the device, or
            reserved by a prefetch), with its bytes.
        used: their total (the budget keeps it as it goes).
        evictable: each of them that may be evicted now, with its rank.
        budget_key: where the budget was set, for the hint.
    """
    if fits(used, needed, budget):
        return BudgetDecision()
    victims: list[str] = []
    freed = 0
    for victim in eviction_order(evictable):
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
            hint=f"raise {budget_key} to at least {raise_to}, or give "
            f"{', '.join(pinned) or 'the other components'} an offload residency",
        )
    )


def stage_fits(
    stage: str,
    sizes: Mapping[str, int],
    uses: tuple[str, ...],
    pinned: tuple[str, ...],
    budget: int,
    *,
    pipeline: str | None = None,
    others: tuple[str, ...] = (),
    budget_key: str = "memory.device_budget",
    one_at_a_time: tuple[str, ...] = (),
) -> Refusal | None:
    """Check at admission that one stage's components and the pinned ones fit at all.

    ``pipeline`` is named in the message when the budget is a worker's, and ``others``,
    the other pipelines it shares that budget with, when there are any; ``one_at_a_time``
    the uses with step windows, of which ``uses`` holds the largest.
    """
    together = dict.fromkeys((*pinned, *uses))
    needed = sum(sizes[name] for name in together)
    if fits(0, needed, budget):
        return None
    total, limit, *each = format_sizes(needed, budget, *(sizes[name] for name in together))
    parts = ", ".join(f"{name} {size}" for name, size in zip(together, each, strict=True))
    return Refusal(
        code=RefusalCode.MEMORY_BUDGET,
        component=uses[0],
        message=f"stage '{stage}'"
        + ("" if pipeline is None else f" of pipeline '{pipeline}'")
        + f" needs {total} on device at once ({parts}), more than the {limit} budget"
        + (f" (it holds one of {', '.join(one_at_a_time)} at a time)" if one_at_a_time else "")
        + _shared_with(others),
        hint=f"raise {budget_key} to at least {total}, or use "
        "layerwise_offload for the largest component of that stage",
    )


def _shared_with(others: tuple[str, ...]) -> str:
    """Return how a message names the other pipelines a budget is shared with, if any."""
    if not others:
        return ""
    names = ", ".join(f"'{name}'" for name in others)
    return f" it shares with pipeline{'s' * (len(others) > 1)} {names}"


def budget_refusals(
    spec: PipelineSpec,
    loaders: Mapping[str, ComponentLoader],
    shared: SharedBudget | None = None,
) -> list[Refusal]:
    """Refuse a pipeline one of whose stages cannot fit the memory budget at all.

    The budget is the spec's ``memory.device_budget``, or ``shared`` (a worker's, which
    replaces it), beside the components the worker's other pipelines pin. Sizes are
    declared by the kinds (or read from weights-file headers); a component of unknown
    size, and a layerwise one (whose footprint depends on its blocks), is checked when
    it onloads instead.
    """
    budget = spec.memory.device_budget if shared is None else shared.limit
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
    pipeline: str | None = None
    others: tuple[str, ...] = ()
    key = "memory.device_budget"
    if shared is not None:
        sizes.update(shared.pinned)
        pinned += tuple(shared.pinned)
        pipeline, others, key = spec.name, shared.others, shared.key

    def fit(stage: str, uses: tuple[str, ...], windowed: tuple[str, ...] = ()) -> Refusal | None:
        return stage_fits(
            stage,
            sizes,
            uses,
            pinned,
            budget,
            pipeline=pipeline,
            others=others,
            budget_key=key,
            one_at_a_time=windowed,
        )

    found = []
    for stage in spec.stages:
        # with step windows, the largest set of uses the stage holds at once
        together = [tuple(n for n in held if n in sizes) for held in stage.held_together()]
        uses = max(together, key=lambda held: sum(sizes[name] for name in held))
        if uses and (refusal := fit(stage.name, uses, tuple(stage.windows))):
            found.append(refusal)
    # load() onloads a resident component even when no stage uses it
    staged = {name for stage in spec.stages for name in stage.uses}
    for name, component in spec.components.items():
        if (
            name in sizes
            and name not in staged
            and component.residency_mode is ResidencyMode.RESIDENT
            and (refusal := fit("load()", (name,)))
        ):
            found.append(refusal)
    return found


def declared_bytes(loader: ComponentLoader) -> int | None:
    """Return the declared size as the loaded module holds it (quantized weights as
    quantized), or None when unknown or unreadable (refused elsewhere)."""
    try:
        declared = loader.declared_bytes()
    except (OSError, ValueError):
        return None  # a missing or broken weights file is the loader path's refusal
    return None if declared is None else declared - loader.quantized_saving
