"""Whether the next request's first expert is prefetched while this one decodes: a pure
decision, no moves.

Wan 2.2 A14B's denoise stage holds one expert at a time (its uses have step windows), and
a request starts with ``transformer``. Back to back, the next request's first expert can
come onto the device while this request runs its last stage (decode), so that its onload
overlaps the decode instead of delaying the next denoise. That pays only where the budget
holds it beside what stays on the device meanwhile (the stage in use, what cannot be
evicted), and beside every stage the next request runs before its use: else it would be
evicted again, unused, and move twice.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import msgspec

from lifecycle.admission.budget import fits
from lifecycle.spec.sizes import format_sizes

__all__ = ["AheadStage", "PrefetchDecision", "plan_prefetch"]


class AheadStage(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """A stage the next request runs before the prefetched component's.

    Attributes:
        name: the stage.
        held: what it holds on entry beside the component and the pinned ones, with
            their bytes on the device.
    """

    name: str
    held: Mapping[str, int]


class PrefetchDecision(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Whether to onload a component for the next request now, and why.

    Attributes:
        component: the next request's first use of its windowed stage.
        prefetch: onload it now.
        reason: why (or why not), with the numbers.
    """

    component: str
    prefetch: bool
    reason: str


def plan_prefetch(
    component: str,
    *,
    offloaded: bool,
    streams_blocks: bool,
    needed: int,
    budget: int | None,
    kept: Mapping[str, int],
    pinned: Mapping[str, int],
    ahead: Sequence[AheadStage],
    waiting: bool,
    budget_key: str = "memory.device_budget",
) -> PrefetchDecision:
    """Decide whether to onload ``component`` now for the next request.

    Args:
        component: the next request's first expert.
        offloaded: it is off the device now (else there is nothing to move).
        streams_blocks: it is layerwise offloaded: its blocks stream in as they run, and
            a whole onload would hold what that mode never holds.
        needed: the bytes it holds on the device.
        budget: the device budget; None: no limit.
        kept: what stays on the device while it would move (in use, or never evicted),
            with its bytes.
        pinned: those of ``kept`` that stay on the device for good (explicitly resident).
        ahead: the stages the next request runs before its use, in order.
        waiting: requests wait for memory: they go first, and a prefetch takes none.
        budget_key: where the budget was set, for the reasons.
    """

    def no(reason: str) -> PrefetchDecision:
        return PrefetchDecision(component=component, prefetch=False, reason=reason)

    if not offloaded:
        return no(f"'{component}' is not offloaded: nothing to move")
    if streams_blocks:
        return no(
            f"'{component}' is layerwise offloaded: its blocks stream in as they run, so it "
            "is never onloaded whole ahead of its use"
        )
    if waiting:
        return no("requests wait for memory: they go first")
    if budget is None:
        return PrefetchDecision(
            component=component,
            prefetch=True,
            reason=f"no device budget: '{component}' onloads while this request decodes",
        )
    used = sum(kept.values())
    if not fits(used, needed, budget):
        size, taken, total, limit = format_sizes(needed, used, used + needed, budget)
        names = ", ".join(sorted(kept)) or "nothing"
        return no(
            f"'{component}' needs {size} beside the {taken} kept on the device now "
            f"({names}): {total}, over the {limit} of {budget_key}"
        )
    staying = sum(pinned.values())
    for stage in ahead:
        before = staying + sum(stage.held.values())
        if not fits(before, needed, budget):
            size, taken, total, limit = format_sizes(needed, before, before + needed, budget)
            return no(
                f"'{component}' needs {size} beside the {taken} stage '{stage.name}' of the "
                f"next request holds before its use: {total}, over the {limit} of "
                f"{budget_key}; it would be evicted unused"
            )
    size, taken, limit = format_sizes(needed, used, budget)
    return PrefetchDecision(
        component=component,
        prefetch=True,
        reason=f"'{component}' ({size}) fits beside the {taken} kept on the device now and "
        f"beside every stage before its use, within the {limit} of {budget_key}",
    )
