"""Residency: the guards and the work of onload, offload and release.

Guards decide (and touch nothing): the memory budget plans evictions, the
offload guards check the mode, the declared use and the in-use counts. The
work carries the decisions out through the component's weight store and
arms or disarms its attention, registering an undo for each step.
"""

from __future__ import annotations

import contextlib
import shutil
import time
from collections.abc import Iterable, Mapping
from pathlib import Path

import msgspec
import torch
from torch import nn

from attention.layer import arm_all, disarm_all
from components import ResidencyMode
from components.offload import StoreOptions, WeightStore, device_footprint, make_store
from lifecycle import offload_folder
from lifecycle.admission.budget import fits, plan_onload
from lifecycle.config import PipelineSpec
from lifecycle.events import Direction, Move, Observers
from lifecycle.logs import get_logger
from lifecycle.machine import MoveArgs, TransitionContext
from lifecycle.refusals import Refusal, RefusalCode
from lifecycle.slots import ComponentSlot
from lifecycle.states import ComponentState
from lifecycle.timeline import Timeline

log = get_logger("lifecycle")

__all__ = ["Move", "Residency"]  # Move lives in lifecycle.events; kept importable from here


class Residency:
    """Move components' weights between the device and their offload target.

    Args:
        spec: the pipeline spec (memory settings, stages).
        slots: the orchestrator's components by name.
        device: the compute device.
        observers: who receives every move.

    Attributes:
        prefetches: whether stages prefetch the next stage's components (CUDA only).
    """

    def __init__(
        self,
        spec: PipelineSpec,
        slots: Mapping[str, ComponentSlot],
        device: torch.device,
        observers: Observers,
    ) -> None:
        self.spec = spec
        self.slots = slots
        self.device = device
        # only on CUDA does a copy overlap compute, so only there does a stage prefetch
        self.prefetches = device.type == "cuda"
        self.timeline = Timeline(spec.stages)
        self.observers = observers
        self._started = time.perf_counter()
        self._folder: Path | None = None
        # the budget's running total: the bytes charged for each component on the device
        # (or reserved there by a prefetch), and their sum
        self._charged: dict[str, int] = {}
        self._charged_total = 0
        # what adapters hold on the device (their matrices, the bases merges keep) by
        # key: counted in the total, never evicted
        self._held: dict[str, int] = {}

    # -- guards ----------------------------------------------------------------

    def memory_budget(self, name: str, context: TransitionContext) -> list[Refusal]:
        """Refuse an onload that cannot fit; otherwise record whom to evict first.

        A component may be evicted exactly when its own offload guards would let the
        budget offload it now (``may_offload`` with an eviction), so that an onload is
        refused up front rather than failing half-way through its evictions.
        """
        budget = self.spec.memory.device_budget
        if isinstance(budget, msgspec.UnsetType):
            return []
        needed = self.slots[name].footprint
        used = self._used_by_others(name)
        if fits(used, needed, budget):
            return []  # no need to look at anyone else
        charged = {other: size for other, size in self._charged.items() if other != name}
        eviction = MoveArgs(eviction=True, request_id=context.request_id)
        after = context.args.position
        evictable = {
            other: self.timeline.distance_to_next_use(other, after)
            for other in charged
            if self.slots[other].lifecycle.may_offload(eviction)
        }
        decision = plan_onload(name, needed, budget, charged, used, evictable)
        if decision.refusal is not None:
            return [decision.refusal]
        context.evictions = decision.victims
        return []

    def offloadable(self, name: str, context: TransitionContext) -> list[Refusal]:
        """Refuse to offload a component kept resident, unless the budget evicts it."""
        slot = self.slots[name]
        if slot.mode is not ResidencyMode.RESIDENT:
            return []
        if context.args.eviction and slot.may_be_evicted:
            return []
        return [
            Refusal(
                code=RefusalCode.NOT_OFFLOADABLE,
                component=name,
                message=f"component '{name}' is explicitly resident: it is never offloaded",
                hint=f'set components.{name}.residency = "component_offload" to let it move',
            )
        ]

    def use_declared(self, name: str, context: TransitionContext) -> list[Refusal]:
        """Refuse to offload a component no stage uses: nothing would bring it back."""
        if self.timeline.is_used(name):
            return []
        return [
            Refusal(
                code=RefusalCode.UNDECLARED_USE,
                component=name,
                message=f"component '{name}' is used by no stage, so nothing would onload it",
                hint=f"add '{name}' to the uses of the stage that needs it",
            )
        ]

    def not_in_use(self, name: str, context: TransitionContext) -> list[Refusal]:
        """Refuse to move or release a component an open request is using."""
        in_use_by = self.slots[name].in_use_by
        if not in_use_by:
            return []
        users = sorted(in_use_by)
        return [
            Refusal(
                code=RefusalCode.IN_USE,
                component=name,
                message=f"component '{name}' is in use by request(s) {', '.join(users)}",
                hint="wait for those requests' stages to end, or cancel the requests",
            )
        ]

    # -- work --------------------------------------------------------------------

    def onload(self, name: str, context: TransitionContext) -> None:
        """Evict what the budget guard chose, then bring ``name`` onto the device and arm it."""
        if context.evictions:
            eviction = MoveArgs(eviction=True, request_id=context.request_id)
            for victim in context.evictions:
                self.slots[victim].lifecycle.offload(eviction)
                context.on_rollback(self.slots[victim].lifecycle.onload)
        slot = self.slots[name]
        started = time.perf_counter()
        if slot.store is None:  # the first move builds the store (refusing a module not loaded)
            slot.store = self._new_store(slot, resident=True)
            moved = slot.store.nbytes
        else:
            moved = slot.store.onload()
        slot.reserved = False
        arm_all(slot.layers)
        context.on_rollback(lambda: self._stow(slot))
        self._charge(slot)
        if context.is_logged or self.observers.attached:
            self._record(slot, "onload", moved, started, context)

    def offload(self, name: str, context: TransitionContext) -> None:
        """Disarm ``name`` and take its weights off the device."""
        slot = self.slots[name]
        started = time.perf_counter()
        layers = slot.layers
        disarm_all(layers)
        if context.source is ComponentState.RESIDENT:
            context.on_rollback(lambda: arm_all(layers))
        if slot.store is None:  # the first move builds the store (refusing a module not loaded)
            slot.store = self._new_store(slot, resident=False)
            moved = slot.store.nbytes
        else:
            moved = slot.store.offload()
        if self._refund(slot):
            context.on_rollback(lambda: self._charge(slot))
        if context.is_logged or self.observers.attached:
            self._record(slot, "offload", moved, started, context)

    def release(self, name: str, context: TransitionContext) -> None:
        """Disarm ``name`` and drop its module, its store and any offload file."""
        slot = self.slots[name]
        disarm_all(slot.layers)
        slot.forget()
        self._refund(slot)

    def prefetch(self, names: Iterable[str]) -> None:
        """Start onloading ``names`` early where the copy can overlap compute.

        Only on CUDA, where a store whose target allows it overlaps the copy
        (a host store's copy stream, a disk store's reader thread); each prefetch
        reserves the component's footprint in the budget and never evicts. The
        onload transition completes it; ``cancel_prefetch`` gives it up.
        """
        if not self.prefetches:
            return
        for name in names:
            slot = self.slots[name]
            if (
                slot.reserved
                or slot.lifecycle.state is not ComponentState.OFFLOADED
                or slot.store is None
                or not self._fits(slot)
            ):
                continue
            slot.reserved = slot.store.prefetch() > 0
            if slot.reserved:
                self._charge(slot)

    def cancel_prefetch(self, names: Iterable[str]) -> None:
        """Give up the prefetches of ``names`` that no onload completed."""
        if not self.prefetches:
            return
        for name in names:
            slot = self.slots[name]
            if slot.reserved and slot.lifecycle.state is ComponentState.OFFLOADED:
                assert slot.store is not None
                slot.store.offload()  # waits for the copy, then frees it
                slot.reserved = False
                self._refund(slot)

    def _charge(self, slot: ComponentSlot) -> None:
        """Count ``slot``'s footprint in the running total (once, however often called)."""
        if slot.name not in self._charged:
            self._charged[slot.name] = slot.footprint
            self._charged_total += slot.footprint

    def _refund(self, slot: ComponentSlot) -> bool:
        """Take ``slot`` out of the running total; tell whether it was in it."""
        charged = self._charged.pop(slot.name, None)
        if charged is None:
            return False
        self._charged_total -= charged
        return True

    def hold_refusals(self, key: str, nbytes: int) -> list[Refusal]:
        """Refuse holding ``nbytes`` more under ``key`` (beside what it holds) past the budget."""
        budget = self.spec.memory.device_budget
        if isinstance(budget, msgspec.UnsetType):
            return []
        used = self._charged_total - self._held.get(key, 0)
        if fits(used, nbytes, budget):
            return []
        return [
            Refusal(
                code=RefusalCode.MEMORY_BUDGET,
                component=key,
                message=f"{key} needs {nbytes} bytes on the device, but {used} of the "
                f"budget's {budget} are taken",
                hint="raise memory.device_budget, or use fewer or lower-rank adapters at once",
            )
        ]

    def hold(self, key: str, nbytes: int) -> None:
        """Count ``nbytes`` held on the device under ``key`` (replacing what it held)."""
        self._charged_total += nbytes - self._held.get(key, 0)
        self._held[key] = nbytes
        if not nbytes:
            del self._held[key]

    def _used_by_others(self, name: str) -> int:
        """Return the bytes the running total counts for every component but ``name``."""
        return self._charged_total - self._charged.get(name, 0)

    def _stow(self, slot: ComponentSlot) -> None:
        """Undo an onload: disarm and take the weights back off the device."""
        disarm_all(slot.layers)
        if slot.store is not None:
            slot.store.offload()
        self._refund(slot)

    def _fits(self, slot: ComponentSlot) -> bool:
        """Tell whether ``slot`` fits the budget beside what it counts now, evicting nobody."""
        budget = self.spec.memory.device_budget
        if isinstance(budget, msgspec.UnsetType):
            return True
        return fits(self._used_by_others(slot.name), slot.footprint, budget)

    def footprint(self, slot: ComponentSlot) -> int:
        """Return the most bytes ``slot`` holds on the device, as its store reports it."""
        if slot.store is not None:
            return slot.store.footprint
        target = self.spec.memory.offload_target
        return device_footprint(slot.loaded_module(), slot.mode, target, self._store_options(slot))

    def _new_store(self, slot: ComponentSlot, *, resident: bool) -> WeightStore:
        target = self.spec.memory.offload_target
        options = self._store_options(slot)
        return make_store(slot.loaded_module(), slot.mode, target, options, resident=resident)

    def _store_options(self, slot: ComponentSlot) -> StoreOptions:
        config = slot.spec.layerwise_config
        return StoreOptions(
            device=self.device,
            file=lambda: self._offload_folder() / f"{slot.name}.safetensors",
            blocks=_blocks(slot),
            prefetch=config.prefetch,
            resident_layers=config.resident_layers,
            verify=self.spec.memory.verify_offload,
        )

    def _offload_folder(self) -> Path:
        """Return this orchestrator's own folder under ``memory.offload_dir``, made on first use.

        Each orchestrator gets a fresh one, so that workers serving the same spec
        never share (or delete) each other's only copy of the weights; folders
        left by a dead orchestrator are reclaimed then.
        """
        if self._folder is None:
            self._folder = offload_folder.create(Path(self.spec.memory.offload_dir), self.spec.name)
        return self._folder

    def close(self) -> None:
        """Remove this orchestrator's offload folder (its stores removed their files).

        Raises:
            OSError: the folder could not be removed whole; what is left is
                reclaimed by a later orchestrator once this process is gone.
        """
        folder, self._folder = self._folder, None
        if folder is not None:
            with contextlib.suppress(FileNotFoundError):  # already gone is what close wants
                shutil.rmtree(folder)

    def _record(
        self,
        slot: ComponentSlot,
        direction: Direction,
        moved: int,
        started: float,
        context: TransitionContext,
    ) -> None:
        """Log one move and hand it to the observers (called only when one of them reads it)."""
        finished = time.perf_counter()
        assert slot.store is not None  # every move goes through the store
        move = Move(
            component=slot.name,
            direction=direction,
            target=slot.store.target,
            bytes=moved,
            seconds=round(finished - started, 6),
            request_id=context.request_id,
            at=round(finished - self._started, 6),
        )
        if context.is_logged:
            log.info(
                "residency.moved",
                component=move.component,
                direction=move.direction,
                target=move.target,
                bytes=move.bytes,
                seconds=move.seconds,
                request_id=move.request_id,
            )
        if self.observers.attached:
            self.observers.emit(move)


def _blocks(slot: ComponentSlot) -> nn.ModuleList | None:
    """Return the blocks a layerwise component streams; None in any other mode.

    Raises:
        OffloadError: its kind builds no ``nn.ModuleList`` block stack (admission
            refuses that first; a layerwise store is never a whole one instead).
    """
    if slot.mode is not ResidencyMode.LAYERWISE_OFFLOAD:
        return None  # with no stack declared, the store factory refuses layerwise
    return slot.loader.blocks(slot.loaded_module())
