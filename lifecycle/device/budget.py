"""The device budget: what each component holds on the device, and whom an onload evicts.

One budget per ``SharedDevice``, whatever the number of pipelines on it: the running
total is kept as components move (a move adds or takes one entry), and the order of
eviction is decided by the pure ``lifecycle.admission.budget.plan_onload``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Protocol

from lifecycle.admission.budget import EvictionRank, fits, plan_onload
from lifecycle.device.slots import ComponentSlot
from lifecycle.device.timeline import Timeline
from lifecycle.machines.engine import MoveArgs, TransitionContext
from lifecycle.refusals import Refusal, RefusalCode

__all__ = ["DeviceBudget"]


class Pipelines(Protocol):
    """What the budget asks of the pipelines on its device (``SharedDevice`` answers)."""

    def pipeline_of(self, request_id: str) -> str | None:
        """Return the key of the pipeline ``request_id`` is open for, if any."""

    def timeline_of(self, key: str) -> Timeline:
        """Return the request timeline of the pipeline ``key``."""

    def last_asked(self, key: str) -> int:
        """Return when the pipeline ``key`` last opened a request (a device-wide count)."""


class DeviceBudget:
    """The bytes charged on one device, and the ``memory_budget`` guard of every onload.

    Args:
        limit: the most bytes resident at once; None: no limit.
        key: where the limit was set (``memory.device_budget``, ``--device-budget``),
            for the hints.
        pipelines: the pipelines on the device: whose request moves a component, their
            timelines, when each was last asked for.

    Attributes:
        charged: each component on the device (or reserved there by a prefetch), with
            its bytes.
        total: their sum.
    """

    def __init__(
        self,
        limit: int | None,
        key: str,
        pipelines: Pipelines,
    ) -> None:
        self.limit = None if limit is None else int(limit)  # a plain int: it is encoded
        self.key = key
        self.charged: dict[ComponentSlot, int] = {}
        self.total = 0
        # what adapters hold on the device (their matrices, the bases merges keep) by
        # key: counted in the total, never evicted
        self._held: dict[str, int] = {}
        self._pipelines = pipelines

    def memory_budget(
        self, slots: Mapping[str, ComponentSlot], name: str, context: TransitionContext
    ) -> list[Refusal]:
        """Refuse an onload of ``slots[name]`` that cannot fit; else record whom to evict first.

        A component may be evicted exactly when its own offload guards would let the
        budget offload it now (``offload.may`` with an eviction), so that an onload is
        refused up front rather than failing half-way through its evictions.
        """
        limit = self.limit
        if limit is None:
            return []
        slot = slots[name]
        needed = slot.footprint
        used = self.total - self.charged.get(slot, 0)
        if fits(used, needed, limit):
            return []  # no need to look at anyone else
        return self._plan_evictions(slot, needed, used, limit, context)

    def _plan_evictions(
        self,
        slot: ComponentSlot,
        needed: int,
        used: int,
        limit: int,
        context: TransitionContext,
    ) -> list[Refusal]:
        """Rank every other charged component, let the pure plan choose, and keep its choice.

        Components are named as the pipeline being served (the request's, else the
        component's own) calls them; those it does not use by their device key.
        """
        rid = context.request_id
        pipelines = self._pipelines
        served = (pipelines.pipeline_of(rid) if rid is not None else None) or slot.home
        timeline = pipelines.timeline_of(served)
        after = context.args.position
        eviction = MoveArgs(eviction=True, request_id=rid)
        others = {other.label(served): other for other in self.charged if other is not slot}
        evictable = {
            label: EvictionRank(
                last_asked=max(pipelines.last_asked(user) for user in other.users),
                distance=timeline.distance_to_next_use(other.users[served], after)
                if served in other.users
                else math.inf,
            )
            for label, other in others.items()
            if other.lifecycle.offload.may(eviction)
        }
        charged = {label: self.charged[other] for label, other in others.items()}
        decision = plan_onload(
            slot.label(served), needed, limit, charged, used, evictable, self.key
        )
        if decision.refusal is not None:
            return [decision.refusal]
        context.evictions = tuple(others[label].key for label in decision.victims)
        return []

    def charge(self, slot: ComponentSlot) -> None:
        """Count ``slot``'s footprint in the running total (once, however often called)."""
        if slot not in self.charged:
            self.charged[slot] = slot.footprint
            self.total += slot.footprint

    def refund(self, slot: ComponentSlot) -> bool:
        """Take ``slot`` out of the running total; tell whether it was in it."""
        charged = self.charged.pop(slot, None)
        if charged is None:
            return False
        self.total -= charged
        return True

    def fits_now(self, slot: ComponentSlot) -> bool:
        """Tell whether ``slot`` fits beside what is charged now, evicting nobody."""
        limit = self.limit
        if limit is None:
            return True
        return fits(self.total - self.charged.get(slot, 0), slot.footprint, limit)

    def hold_refusals(self, key: str, nbytes: int) -> list[Refusal]:
        """Refuse holding ``nbytes`` under ``key`` (instead of what it holds) past the limit."""
        limit = self.limit
        if limit is None:
            return []
        used = self.total - self._held.get(key, 0)
        if fits(used, nbytes, limit):
            return []
        return [
            Refusal(
                code=RefusalCode.MEMORY_BUDGET,
                component=key,
                message=f"{key} needs {nbytes} bytes on the device, but {used} of the "
                f"budget's {limit} are taken",
                hint=f"raise {self.key}, or use fewer or lower-rank adapters at once",
            )
        ]

    def hold(self, key: str, nbytes: int) -> None:
        """Count ``nbytes`` held on the device under ``key`` (replacing what it held)."""
        self.total += nbytes - self._held.get(key, 0)
        self._held[key] = nbytes
        if not nbytes:
            del self._held[key]
