"""Residency: the guards and the work of onload, offload and release.

Guards decide (and touch nothing): the memory budget (``DeviceBudget``, one per
device) plans evictions, the pipeline's sleep keeps its components off, the
offload guards check the mode, the declared use and the in-use counts. The
work carries the decisions out through the component's weight store and
arms or disarms its attention, registering an undo for each step.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from pathlib import Path

import torch
from torch import nn

from attention.layer import arm_all, disarm_all
from components import ResidencyMode
from components.offload import StoreOptions, WeightStore, device_footprint, make_store
from components.offload.removal import remove_path
from lifecycle import offload_folder
from lifecycle.device.shared import SharedDevice
from lifecycle.device.slots import ComponentSlot
from lifecycle.device.timeline import Timeline
from lifecycle.events import Direction, Move
from lifecycle.logs import get_logger
from lifecycle.machines.engine import MoveArgs, TransitionContext
from lifecycle.machines.tables import ComponentState
from lifecycle.refusals import Refusal, RefusalCode
from lifecycle.spec.structs import PipelineSpec

__all__ = ["Residency"]

log = get_logger("lifecycle")


class Residency:
    """Move one pipeline's components' weights between the device and their offload target.

    A component another pipeline shares is moved by the residency of the pipeline that
    built it (its home), whichever pipeline's request asks.

    Args:
        spec: the pipeline spec (memory settings, stages).
        slots: the orchestrator's components by name.
        device: the compute device.
        shared: the device the pipeline is on: its budget, its sleeping pipelines.
        key: the pipeline's key on ``shared``.
        timeline: the pipeline's request timeline.

    Attributes:
        prefetches: whether stages prefetch the next stage's components (CUDA only).
    """

    def __init__(
        self,
        spec: PipelineSpec,
        slots: Mapping[str, ComponentSlot],
        device: torch.device,
        shared: SharedDevice,
        key: str,
        timeline: Timeline,
    ) -> None:
        self.spec = spec
        self.slots = slots
        self.device = device
        # only on CUDA does a copy overlap compute, so only there does a stage prefetch
        self.prefetches = device.type == "cuda"
        self.timeline = timeline
        self.budget = shared.budget
        self.key = key
        self._shared = shared
        self._started = time.perf_counter()
        self._folder: Path | None = None
        self._closed = False

    # -- guards ----------------------------------------------------------------

    def pipeline_awake(self, name: str, context: TransitionContext) -> list[Refusal]:
        """Refuse to onload a component while every pipeline using it sleeps.

        ``wake`` takes its pipeline off the sleeping set before it onloads, so its own
        onloads pass.
        """
        slot = self.slots[name]
        if not self._shared.all_asleep(slot.users):
            return []
        sleepers = ", ".join(sorted(slot.users))
        return [
            Refusal(
                code=RefusalCode.PIPELINE_ASLEEP,
                component=name,
                message=f"component '{name}' belongs to pipeline(s) {sleepers}, which sleep: "
                "nothing of theirs is onloaded until they wake",
                hint="wake the pipeline first (Orchestrator.wake(), POST "
                "/v1/pipelines/{name}/wake), or set serving.auto_wake = true",
            )
        ]

    def offloadable(self, name: str, context: TransitionContext) -> list[Refusal]:
        """Refuse to offload a component kept resident, unless the budget evicts it or its
        pipeline goes to sleep (a sharded component stays: its shards cannot move)."""
        slot = self.slots[name]
        if slot.mode is not ResidencyMode.RESIDENT:
            return []
        args = context.args
        if (args.eviction and slot.may_be_evicted) or (args.sleeping and not slot.is_sharded):
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
        """Refuse to offload a component no stage uses: nothing would bring it back (but
        the wake of a pipeline that goes to sleep)."""
        if self.timeline.is_used(name) or context.args.sleeping:
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
            slots = self._shared.slots
            for victim in context.evictions:
                evicted = slots[victim].lifecycle
                evicted.offload(eviction)
                context.on_rollback(evicted.onload)
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
        self.budget.charge(slot)
        if context.is_logged or slot.lifecycle.observers.attached:
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
        streamed = slot.store.take_streamed()
        if self.budget.refund(slot):
            context.on_rollback(lambda: self.budget.charge(slot))
        if context.is_logged or slot.lifecycle.observers.attached:
            self._record(slot, "offload", moved, started, context, streamed)

    def release(self, name: str, context: TransitionContext) -> None:
        """Disarm ``name`` and drop its module, its store and any offload file."""
        slot = self.slots[name]
        disarm_all(slot.layers)
        slot.forget()
        self.budget.refund(slot)
        self._shared.drop_slot(slot)
        if self._closed:
            self._remove_folder_when_done()

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
                or not self.budget.fits_now(slot)
            ):
                continue
            slot.reserved = slot.store.prefetch() > 0
            if slot.reserved:
                self.budget.charge(slot)

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
                self.budget.refund(slot)

    def _stow(self, slot: ComponentSlot) -> None:
        """Undo an onload: disarm and take the weights back off the device."""
        disarm_all(slot.layers)
        if slot.store is not None:
            slot.store.offload()
        self.budget.refund(slot)

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
            runs=slot.loader.blocks_run(),
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

        A component it built that another pipeline still shares keeps the folder until
        that component is released too.

        Raises:
            OSError: the folder could not be removed whole; what is left is
                reclaimed by a later orchestrator once this process is gone.
        """
        self._closed = True
        if not self._builds_alive():
            self._remove_folder()

    def _builds_alive(self) -> bool:
        """Tell whether a component this residency built is still on the device for others."""
        on_device = self._shared.slots
        return any(
            slot.home == self.key
            and slot.key in on_device  # a release takes it off first
            and self.key not in slot.users
            and slot.users
            for slot in self.slots.values()
        )

    def _remove_folder_when_done(self) -> None:
        """Remove the folder of a closed pipeline once its last shared component is released."""
        if self._builds_alive():
            return
        try:
            self._remove_folder()
        except OSError as err:  # reclaimed by a later orchestrator once this process is gone
            log.warning("residency.folder_left", error=str(err))

    def _remove_folder(self) -> None:
        folder, self._folder = self._folder, None
        if folder is not None:
            remove_path(folder)  # already gone is what close wants, and so is a tampered tree

    def _record(
        self,
        slot: ComponentSlot,
        direction: Direction,
        moved: int,
        started: float,
        context: TransitionContext,
        streamed: int = 0,
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
            streamed=streamed,
            reason=context.args.reason,
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
                **({"streamed": streamed} if streamed else {}),
                **({"reason": move.reason} if move.reason else {}),
            )
        observers = slot.lifecycle.observers
        if observers.attached:
            observers.emit(move)


def _blocks(slot: ComponentSlot) -> nn.ModuleList | None:
    """Return the blocks a layerwise component streams; None in any other mode.

    Raises:
        OffloadError: its kind builds no ``nn.ModuleList`` block stack (admission
            refuses that first; a layerwise store is never a whole one instead).
    """
    if slot.mode is not ResidencyMode.LAYERWISE_OFFLOAD:
        return None  # with no stack declared, the store factory refuses layerwise
    return slot.loader.blocks(slot.loaded_module())
