"""The adapters (LoRA) of an orchestrator: their lifecycle's guards and work, and switches.

An adapter is admitted from its file's header (``lifecycle.admission.adapters``),
loaded (its matrices on the device, counted in the budget), then active:

- merged: merged into its component's weights for the requests that name it. The
  merged weights are always computed from the kept base, so unmerging puts the
  very base tensors back (bit for bit) and the weights depend only on the set
  merged. A request whose merged set differs from the component's switches it
  (``settle``) before it uses the component, once no other request uses it: a
  switch never changes weights under a running request. Switches are counted.
- unmerged: attached to its layers from load to release; each row of a batch adds
  its own low-rank delta at its own scale (``components.adapters.rows``), so
  requests with different sets share one forward and the weights never change.

Triggers run on the components' lock, so an adapter's transition and a
component's never interleave.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from components.adapters import LoraMatrices, attach, linear_layers, merged_weight, read_matrices
from lifecycle.admission.adapters import AdapterAdmission
from lifecycle.device.moves import Residency
from lifecycle.device.slots import ComponentSlot
from lifecycle.events import AdapterSwitched, Observers
from lifecycle.logs import get_logger
from lifecycle.machines.adapter import AdapterLifecycle, AdapterMachine
from lifecycle.machines.engine import Check, MoveArgs, TransitionContext, Work
from lifecycle.machines.tables import AdapterState, Guard
from lifecycle.plan import AdapterView
from lifecycle.refusals import Refusal, RefusalCode, TransitionRefused
from lifecycle.shown import shown
from lifecycle.spec.structs import AdapterSpec

__all__ = ["AdapterKeeper", "Rows"]

log = get_logger("lifecycle")

Rows = Sequence[Mapping[str, float]]
"""Each row's adapters by name with the scale it runs them at."""

_ADMISSION_GUARDS = {
    Guard.TARGETS_FIT: (
        RefusalCode.ADAPTER_TARGET_MISMATCH,
        RefusalCode.ADAPTER_NATIVE_UNSUPPORTED,
    ),
    Guard.COMPONENT_KEPT: (RefusalCode.ADAPTER_OFFLOADED_COMPONENT,),
    Guard.COMPONENT_WHOLE: (RefusalCode.ADAPTER_SHARDED_COMPONENT,),
}


@dataclass
class AdapterSlot:
    """One adapter: its spec, what admission found, its matrices once loaded, and how many
    switches changed it."""

    name: str
    spec: AdapterSpec
    lifecycle: AdapterLifecycle
    admission: AdapterAdmission | None = None
    matrices: dict[str, LoraMatrices] = field(default_factory=dict)
    handles: list[RemovableHandle] = field(default_factory=list)
    switches: int = 0

    @property
    def component(self) -> str:
        """Return the component it changes ("" until admission tells it)."""
        return self.lifecycle.component


class AdapterKeeper:
    """Run the lifecycle of every adapter of one pipeline and switch merged sets.

    Args:
        slots: the orchestrator's components by name.
        residency: where adapter bytes are counted in the budget.
        device: where adapter matrices live.
        lock: the components' machine lock (adapters move under it too).
        observers: who hears of every adapter transition and switch.
        wait_timeout: how long a switch waits for other requests to leave its component.
        pipeline: the pipeline's key on its device: a merge never changes a component
            another pipeline shares with it.
    """

    def __init__(
        self,
        slots: Mapping[str, ComponentSlot],
        residency: Residency,
        device: torch.device,
        lock: threading.RLock,
        observers: Observers,
        wait_timeout: float,
        pipeline: str,
    ) -> None:
        self.slots = slots
        self.pipeline = pipeline
        self.residency = residency
        self.device = device
        self.lock = lock
        self.idle = threading.Condition(lock)
        self.wait_timeout = wait_timeout
        self.machine = AdapterMachine("adapters", lock)
        self.observers = observers
        self.adapters: dict[str, AdapterSlot] = {}
        # per component: the merged adapters with their scales, and the base weight of
        # every layer a merge changed (put back exactly when no merged adapter needs it)
        self.merged: dict[str, dict[str, float]] = {}
        self.bases: dict[str, dict[str, torch.Tensor]] = {}
        self.switches = 0

    # -- the set of adapters -----------------------------------------------------

    def add(self, name: str, spec: AdapterSpec) -> AdapterSlot:
        """Configure adapter ``name`` (CONFIGURED); admission and loading come next."""
        lifecycle = AdapterLifecycle(
            name,
            component="" if not isinstance(spec.component, str) else spec.component,
            checks=self._checks(name),
            work=self._work(name),
            observers=self.observers,
        )
        self.machine.add_adapter(lifecycle)
        slot = AdapterSlot(name, spec, lifecycle)
        self.adapters[name] = slot
        return slot

    def admit(self, name: str, admission: AdapterAdmission) -> None:
        """Admit ``name`` with what admission found (refused: it stays CONFIGURED).

        Raises:
            TransitionRefused: with admission's refusals.
        """
        slot = self.adapters[name]
        slot.admission = admission
        if admission.component is not None:
            slot.lifecycle.component = admission.component
        slot.lifecycle.admit()

    def load(self, name: str) -> None:
        """Load ``name``'s matrices; an unmerged adapter is attached (ACTIVE) at once."""
        slot = self.adapters[name]
        slot.lifecycle.load()
        if slot.spec.mode == "unmerged":
            slot.lifecycle.activate()

    def remove(self, name: str) -> None:
        """Take ``name`` out of use (waiting for requests on its component), then release it."""
        slot = self.adapter(name)
        with self.lock:
            if slot.lifecycle.state is AdapterState.ACTIVE:
                if slot.spec.mode == "merged":
                    self._wait_idle(slot.component, None)
                slot.lifecycle.deactivate()
            slot.lifecycle.release()
            del self.adapters[name]
            self.machine.remove_model(slot.lifecycle)

    def adapter(self, name: str) -> AdapterSlot:
        """Return adapter ``name``.

        Raises:
            KeyError: no adapter has that name (the message lists the known ones).
        """
        try:
            return self.adapters[name]
        except KeyError:
            raise KeyError(
                f"no adapter {shown(name)}; adapters: {', '.join(sorted(self.adapters)) or 'none'}"
            ) from None

    def views(self) -> list[AdapterView]:
        """Return every adapter's view, by name."""
        views = []
        for name, slot in sorted(self.adapters.items()):
            admission = slot.admission
            component = "" if admission is None else admission.component or ""
            views.append(
                AdapterView(
                    name=name,
                    component=component,
                    state=slot.lifecycle.state,
                    mode=slot.spec.mode,
                    scale=slot.spec.scale,
                    path=slot.spec.path,
                    merged_scale=self.merged.get(component, {}).get(name),
                    switches=slot.switches,
                )
            )
        return views

    # -- requests --------------------------------------------------------------

    def check_rows(self, rows: Rows) -> None:
        """Check that every adapter ``rows`` name is usable, and that the rows can share a batch.

        Rows may name different unmerged sets of a component only where its kind
        finds each row in a forward (``ComponentLoader.adapter_rows``).

        Raises:
            ValueError: an unknown or unloaded adapter (the message lists the known
                ones), or rows that name different merged sets for one component, or
                different unmerged sets where its kind cannot tell rows apart.
        """
        named = {name for row in rows for name in row}
        for name in sorted(named):
            slot = self.adapters.get(name)
            if slot is None or slot.lifecycle.state not in (
                AdapterState.LOADED,
                AdapterState.ACTIVE,
            ):
                known = ", ".join(sorted(self.usable())) or "none"
                raise ValueError(f"unknown adapter {shown(name)}; known adapters: {known}")
        for component in {self.adapters[name].component for name in named}:
            for mode in ("merged", "unmerged"):
                sets = {tuple(sorted(self._of(row, component, mode).items())) for row in rows}
                held = self.slots[component]
                # the custom DiTs pack every row into one sequence: only native keeps rows
                native = held.plan is not None and held.plan.loader == "native"
                mixed_ok = mode == "unmerged" and held.loader.adapter_rows and native
                if len(sets) > 1 and not mixed_ok:
                    raise ValueError(
                        f"the rows of one batch name different {mode} adapters of component "
                        f"'{component}'; run them as separate batches"
                    )

    def usable(self) -> list[str]:
        """Return the adapters a request may name now (loaded or active)."""
        return [
            name
            for name, slot in self.adapters.items()
            if slot.lifecycle.state in (AdapterState.LOADED, AdapterState.ACTIVE)
        ]

    def settle(self, uses: Sequence[str], rows: Rows | None, request_id: str) -> None:
        """Merge into each of ``uses`` exactly the merged adapters ``rows`` name (lock held).

        A component whose merged set must change waits until no request uses it,
        then switches; a component that has no merged adapter loaded is left alone.

        Raises:
            TransitionRefused: other requests still used it after ``wait_timeout``.
        """
        for component in uses:
            if not self._has_merged(component):
                continue
            wanted = self._of(rows[0], component, "merged") if rows else {}
            if wanted == self.merged.get(component, {}):
                continue
            self._wait_idle(component, request_id)
            self._switch(component, wanted, request_id)

    def released(self) -> None:
        """Wake switches waiting for a component to be idle (call with the lock held)."""
        self.idle.notify_all()

    def _has_merged(self, component: str) -> bool:
        return any(
            slot.spec.mode == "merged"
            and slot.admission is not None
            and slot.admission.component == component
            for slot in self.adapters.values()
        ) or bool(self.merged.get(component))

    def _of(self, row: Mapping[str, float], component: str, mode: str) -> dict[str, float]:
        """Return the adapters of ``row`` on ``component`` in ``mode``, with their scales."""
        found = {}
        for name, scale in row.items():
            slot = self.adapters[name]
            if slot.spec.mode == mode and slot.component == component:
                found[name] = scale
        return found

    def _wait_idle(self, component: str, request_id: str | None) -> None:
        in_use_by = self.slots[component].in_use_by
        deadline = time.monotonic() + self.wait_timeout
        while any(rid != request_id for rid in in_use_by):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                users = ", ".join(sorted(in_use_by))
                raise TransitionRefused(
                    component,
                    "activate",
                    self.slots[component].lifecycle.state,
                    [
                        Refusal(
                            code=RefusalCode.IN_USE,
                            component=component,
                            message=f"switching the adapters merged into '{component}' "
                            f"waited {self.wait_timeout:g} s, but requests {users} still "
                            "use it",
                            hint="raise memory.wait_timeout, or use unmerged adapters so that "
                            "requests with different adapters share the component",
                        )
                    ],
                )
            self.idle.wait(remaining)

    def _switch(self, component: str, wanted: Mapping[str, float], request_id: str) -> None:
        """Unmerge what ``wanted`` drops or rescales, then merge what it adds."""
        started = time.perf_counter()
        merged = self.merged.get(component, {})
        args = MoveArgs(request_id=request_id)
        changed = {name for name in {*merged, *wanted} if merged.get(name) != wanted.get(name)}
        for name, scale in sorted(merged.items()):
            if wanted.get(name) != scale:
                self.adapters[name].lifecycle.deactivate(args)
        for name, scale in sorted(wanted.items()):
            if self.merged.get(component, {}).get(name) != scale:
                self.adapters[name].lifecycle.activate(MoveArgs(request_id=request_id, scale=scale))
        self.switches += 1
        for name in changed:
            self.adapters[name].switches += 1
        seconds = round(time.perf_counter() - started, 6)
        now = dict(self.merged.get(component, {}))
        log.info(
            "adapter.switched",
            component=component,
            merged=now,
            seconds=seconds,
            request_id=request_id,
        )
        if self.observers.attached:
            self.observers.emit(
                AdapterSwitched(
                    component=component, merged=now, seconds=seconds, request_id=request_id
                )
            )

    # -- guards (pure) ---------------------------------------------------------

    def _checks(self, name: str) -> dict[Guard, Check]:
        def admitted(guard: Guard) -> Check:
            codes = _ADMISSION_GUARDS[guard]

            def check(context: TransitionContext) -> list[Refusal]:
                admission = self.adapters[name].admission
                if admission is None:
                    raise RuntimeError("admit an adapter through AdapterKeeper.admit")
                return [r for r in admission.refusals if r.code in codes]

            return check

        return {
            **{guard: admitted(guard) for guard in _ADMISSION_GUARDS},
            Guard.MEMORY_BUDGET: partial(self._budget, name),
            Guard.COMPONENT_IDLE: partial(self._idle, name),
        }

    def _budget(self, name: str, context: TransitionContext) -> list[Refusal]:
        slot = self.adapters[name]
        if context.trigger == "load":
            return self.residency.budget.hold_refusals(
                f"adapter '{name}'", self._matrix_bytes(slot)
            )
        if slot.spec.mode == "unmerged":
            return []
        component = slot.component
        key = _base_key(component)
        layers = self._layers(component, slot.matrices)
        kept = self.bases.get(component, {})
        more = sum(_nbytes(layer.weight) for path, layer in layers.items() if path not in kept)
        return self.residency.budget.hold_refusals(key, self._base_bytes(component) + more)

    def _idle(self, name: str, context: TransitionContext) -> list[Refusal]:
        slot = self.adapters[name]
        if slot.spec.mode == "unmerged":
            return []  # attaching never changes weights: a running request is unaffected
        component = self.slots[slot.component]
        shared_with = sorted(key for key in component.users if key != self.pipeline)
        if shared_with:
            return [
                Refusal(
                    code=RefusalCode.IN_USE,
                    component=name,
                    message=f"merged adapter '{name}' would change the weights of "
                    f"'{slot.component}', which pipelines {', '.join(shared_with)} share",
                    hint=f'set adapters.{name}.mode = "unmerged" (the weights never change)',
                )
            ]
        users = [rid for rid in component.in_use_by if rid != context.request_id]
        if not users:
            return []
        return [
            Refusal(
                code=RefusalCode.IN_USE,
                component=name,
                message=f"adapter '{name}' would change the weights of '{slot.component}' "
                f"while requests {', '.join(sorted(users))} use it",
                hint="let those requests finish; a request that names the adapter waits for "
                "them itself",
            )
        ]

    # -- work (each with its undo) ---------------------------------------------

    def _work(self, name: str) -> dict[str, Work]:
        return {
            "load": partial(self._load, name),
            "activate": partial(self._activate, name),
            "deactivate": partial(self._deactivate, name),
            "release": partial(self._release, name),
        }

    def _load(self, name: str, context: TransitionContext) -> None:
        slot = self.adapters[name]
        admission = slot.admission
        assert admission is not None
        assert admission.file is not None
        module = self.slots[slot.component].loaded_module()
        layers = linear_layers(module, admission.targets)
        slot.matrices = read_matrices(
            admission.file.path, admission.targets, layers, admission.file.alpha_ratio, self.device
        )
        key = f"adapter '{name}'"
        self.residency.budget.hold(key, self._matrix_bytes(slot))
        context.on_rollback(lambda: self._drop(slot, key))

    def _activate(self, name: str, context: TransitionContext) -> None:
        slot = self.adapters[name]
        module = self.slots[slot.component].loaded_module()
        layers = linear_layers(module, slot.matrices)
        if slot.spec.mode == "unmerged":
            slot.handles = [
                attach(layer, name, slot.matrices[path]) for path, layer in layers.items()
            ]
            context.on_rollback(lambda: _detach(slot))
            return
        scale = slot.spec.scale if context.args.scale is None else context.args.scale
        merged = self.merged.setdefault(slot.component, {})
        before = dict(merged)
        merged[name] = scale
        context.on_rollback(lambda: self._remerge(slot.component, before))
        self._apply(slot.component)

    def _deactivate(self, name: str, context: TransitionContext) -> None:
        slot = self.adapters[name]
        if slot.spec.mode == "unmerged":
            _detach(slot)
            return
        merged = self.merged[slot.component]
        before = dict(merged)
        del merged[name]
        context.on_rollback(lambda: self._remerge(slot.component, before))
        self._apply(slot.component)

    def _release(self, name: str, context: TransitionContext) -> None:
        slot = self.adapters[name]
        self._drop(slot, f"adapter '{name}'")

    def _drop(self, slot: AdapterSlot, key: str) -> None:
        slot.matrices = {}
        self.residency.budget.hold(key, 0)

    def _remerge(self, component: str, merged: Mapping[str, float]) -> None:
        self.merged[component] = dict(merged)
        self._apply(component)

    def _apply(self, component: str) -> None:
        """Set every layer a merge touches to its base plus the merged adapters' deltas.

        A layer that no merged adapter targets gets its base tensor itself back.
        """
        merged = self.merged.get(component, {})
        kept = self.bases.setdefault(component, {})
        matrices = {name: self.adapters[name].matrices for name in sorted(merged)}
        paths = set(kept).union(*(m.keys() for m in matrices.values()))
        layers = linear_layers(self.slots[component].loaded_module(), sorted(paths))
        # outside inference mode (a request's stage may be in it): the weights are
        # ordinary tensors whatever runs them next
        with torch.inference_mode(False), torch.no_grad():
            for path, layer in layers.items():
                base = kept.get(path, layer.weight.data)
                deltas = [(m[path], merged[n]) for n, m in matrices.items() if path in m]
                if deltas:
                    kept[path] = base
                    layer.weight.data = merged_weight(base, deltas)
                else:
                    layer.weight.data = base
                    kept.pop(path, None)
        self.residency.budget.hold(_base_key(component), self._base_bytes(component))

    def _base_bytes(self, component: str) -> int:
        return sum(_nbytes(base) for base in self.bases.get(component, {}).values())

    def _layers(self, component: str, paths: Mapping[str, object]) -> dict[str, nn.Linear]:
        return linear_layers(self.slots[component].loaded_module(), paths)

    def _matrix_bytes(self, slot: AdapterSlot) -> int:
        """Return the bytes its matrices take (read from the header before they are loaded)."""
        if slot.matrices:
            return sum(m.nbytes for m in slot.matrices.values())
        admission = slot.admission
        assert admission is not None
        layers = self._layers(slot.component, admission.targets)
        return sum(
            target.numel * layers[path].weight.element_size()
            for path, target in admission.targets.items()
        )


def _base_key(component: str) -> str:
    return f"bases kept for merged adapters of '{component}'"


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _detach(slot: AdapterSlot) -> None:
    for handle in slot.handles:
        handle.remove()
    slot.handles = []
