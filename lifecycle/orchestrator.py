"""The orchestrator: admits a pipeline, loads it, and moves its components.

Decisions come from the pure functions of ``lifecycle.admission``; this
module carries them out on the lifecycle machine, whose guards read those
decisions back and whose work does the side effects (building modules,
arming attention, moving weights) with an undo step for each.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from types import TracebackType

import msgspec
import torch
from msgspec import UnsetType
from torch import nn

from attention import Platform
from attention.override import REQUEST_BACKEND
from components import ResidencyMode
from components.batch import Left
from components.mesh import ParallelMesh
from components.recipes import Recipe
from lifecycle import admission as adm
from lifecycle.admission.folder import open_folder
from lifecycle.config import ComponentSpec, PipelineSpec, load_spec
from lifecycle.distributed import world_refusals
from lifecycle.events import Observer, Observers, Refused, RequestBegan, RequestEnded
from lifecycle.loading import Loading
from lifecycle.logs import REQUEST_ID, get_logger
from lifecycle.machine import (
    Check,
    ComponentLifecycle,
    LifecycleMachine,
    TransitionContext,
    Work,
    report_refused,
)
from lifecycle.override import BackendSwitch
from lifecycle.plan import (
    AdmissionPlan,
    ComponentPlan,
    ComponentSnapshot,
    PipelineSnapshot,
    RefusalReport,
)
from lifecycle.refusals import (
    AdmissionRefused,
    InvalidTransition,
    Refusal,
    RequestRefused,
)
from lifecycle.requests import Request, StageKeeper
from lifecycle.residency import Residency
from lifecycle.slots import ComponentSlot
from lifecycle.states import ComponentState
from lifecycle.waiting import MemoryWaiter

log = get_logger("lifecycle")


class ComponentView(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """A read-only look at one component.

    Attributes:
        name: the component's name.
        spec: what the pipeline spec says of it.
        plan: what admission decided, or None before admission.
        state: where it stands now.
        in_use_by: the open requests using it now.
        prefetching: whether a prefetch has started its onload (CUDA host target).
        footprint: the bytes it takes on the device while resident (0 until loaded).
        resident_bytes: the bytes it holds on the device now.
    """

    name: str
    spec: ComponentSpec
    plan: ComponentPlan | None
    state: ComponentState
    in_use_by: tuple[str, ...] = ()
    prefetching: bool = False
    footprint: int = 0
    resident_bytes: int = 0


class Orchestrator:
    """Run the lifecycle of every component of one pipeline.

    Args:
        spec: the decoded pipeline spec.
        platform: where it runs; by default the spec's ``device`` decides.
        observer: receives every event (``lifecycle.events``); ``observe`` attaches more.
    """

    def __init__(
        self,
        spec: PipelineSpec,
        *,
        platform: Platform | None = None,
        observer: Observer | None = None,
    ) -> None:
        self.spec = spec
        self.platform = platform or _platform_for(spec)
        self.device = torch.device(self.platform.kind)
        self._observers = Observers()
        if observer is not None:
            self._observers.attach(observer)
        self._machine = LifecycleMachine(name=spec.name, observers=self._observers)
        self._admission: adm.Admission | None = None
        self._slots: dict[str, ComponentSlot] = {}
        self._residency = Residency(spec, self._slots, self.device, self._observers)
        self._loading = Loading(spec, self._slots, self.platform, self._residency)
        self._stages = StageKeeper(
            self._slots, self._residency, self._machine.lock, self._observers
        )
        self._request_ids = itertools.count(1)
        self._switch = BackendSwitch(self._slots, self.platform)
        loaders = adm.component_loaders(spec)
        for name, component in spec.components.items():
            lifecycle = ComponentLifecycle(name, checks=self._checks(name), work=self._work(name))
            self._machine.add_component(lifecycle)
            self._slots[name] = ComponentSlot(name, component, lifecycle, loaders[name])
        self.recipe: Recipe | None = (
            None if isinstance(spec.source, UnsetType) else open_folder(spec, loaders).recipe
        )
        """How a request runs the stages of a pipeline from a folder (its pipeline class's
        recipe, on the components' loaders); None for a pipeline of kinds, whose stages
        each kind runs itself, and for a folder admission refuses."""

    @classmethod
    def from_file(
        cls,
        path: str | Path,
        *,
        platform: Platform | None = None,
        observer: Observer | None = None,
    ) -> Orchestrator:
        """Decode the spec at ``path`` and build its orchestrator.

        Raises:
            ConfigError: the spec is missing or bad.
        """
        return cls(load_spec(path), platform=platform, observer=observer)

    # -- the public surface -------------------------------------------------

    def observe(self, observer: Observer) -> Callable[[], None]:
        """Hand every event from now on to ``observer`` too; return the call that stops it.

        Events (``lifecycle.events``) arrive on the thread that caused them, often
        with the orchestrator's lock held: an observer returns quickly. One that
        raises is logged and skipped; it never changes what the orchestrator does.
        """
        return self._observers.attach(observer)

    def admit(self) -> AdmissionPlan:
        """Admit every component, or none: return the plan.

        Raises:
            AdmissionRefused: with every refusal of every component; every
                component stays CONFIGURED.
        """
        with self._machine.lock:
            moved = [
                n
                for n, s in self._slots.items()
                if s.lifecycle.state is not ComponentState.CONFIGURED
            ]
            if moved:
                raise InvalidTransition(
                    moved[0], "admit", self._slots[moved[0]].lifecycle.state, ("configured",)
                )
            loaders = {name: slot.loader for name, slot in self._slots.items()}
            admission = adm.admit_pipeline(self.spec, self.platform, loaders)
            self._admission = admission
            for name, slot in self._slots.items():
                slot.admission = admission.components[name]
            refusals = admission.refusals()
            if refusals:
                self._report(refusals, trigger="admit", request_id=None)
                raise AdmissionRefused(self.spec.name, refusals)
            for slot in self._slots.values():
                slot.lifecycle.admit()
            return AdmissionPlan(
                pipeline=self.spec.name,
                platform=self.platform.kind,
                components={name: slot.plan for name, slot in self._slots.items() if slot.plan},
            )

    def load(self) -> None:
        """Load every admitted component and put it in its initial place.

        Resident components end RESIDENT, offloaded ones OFFLOADED. Admits
        first when that has not happened.

        Raises:
            AdmissionRefused: admission was needed and refused.
            TransitionRefused: the layout's world size differs from the launched one.
            TransitionFailed: a component failed to load; it stays ADMITTED.
        """
        with self._machine.lock:
            if self._admission is None or not self._admission.admitted:
                self.admit()
            for slot in self._slots.values():
                if slot.lifecycle.state is ComponentState.ADMITTED:
                    slot.lifecycle.load()
                if slot.lifecycle.state is ComponentState.LOADED:
                    if slot.spec.residency_mode is ResidencyMode.RESIDENT:
                        slot.lifecycle.onload()
                    else:
                        slot.lifecycle.offload()

    @property
    def parallel(self) -> ParallelMesh | None:
        """Return the layout's mesh on this rank once loaded; None in a single process."""
        return self._loading.mesh

    @contextmanager
    def request(
        self,
        request_id: str | None = None,
        *,
        attention_backend: str | None = None,
        priority: int = 0,
    ) -> Iterator[Request]:
        """Open a request; enter its stages with ``request.stage(name)``.

        On exit (also when the body raised) every component the request touched
        is put back where its plan says, and ``request.end`` is logged.
        ``attention_backend`` switches the switchable sites for this request only
        (DESIGN §4.6); it is validated and prepared before the request opens.
        ``priority`` orders its stages among those waiting for memory (higher first,
        with ageing: ``lifecycle.waiting``). ``request.cancel()`` stops it from any
        thread (DESIGN §15).

        Raises:
            ValueError: a request with that id is already open.
            RequestRefused: ``attention_backend`` breaks a rule; nothing was switched.
        """
        rid = request_id or f"r{next(self._request_ids)}"
        if attention_backend is not None:
            try:
                self._switch.prepare(attention_backend)
            except RequestRefused as err:
                self._report(err.refusals, trigger="request", request_id=rid)
                raise
        with self._machine.lock:
            if rid in self._stages.open_requests:
                raise ValueError(f"request {rid!r} is already open; give each request its own id")
            self._stages.open_requests.add(rid)
        request = Request(self._stages, rid, priority, self.recipe)
        started = time.perf_counter()
        # both context variables set and reset by token, not through context managers:
        # a request of N components makes only 2N moves to share what it costs (issue 12)
        token, backend = REQUEST_ID.set(rid), REQUEST_BACKEND.set(attention_backend)
        observers = self._observers
        try:
            try:
                # inside the try that ends the request: an event that cannot be written
                # must not leave its id open
                log.info("request.begin", request_id=rid)
                if observers.attached:
                    observers.emit(RequestBegan(request_id=rid))
                yield request
            finally:
                self._stages.finish(rid, request.touched)
                is_logged = log.is_enabled_for(logging.INFO)
                if is_logged or observers.attached:
                    ended = RequestEnded(
                        request_id=rid,
                        stages=tuple(request.stages),
                        duration_ms=round((time.perf_counter() - started) * 1e3, 3),
                    )
                    if is_logged:
                        log.info(
                            "request.end",
                            request_id=rid,
                            duration_ms=ended.duration_ms,
                            stages=list(ended.stages),
                        )
                    observers.emit(ended)
        finally:
            REQUEST_BACKEND.reset(backend)
            REQUEST_ID.reset(token)

    def onload(self, name: str) -> None:
        """Make component ``name`` RESIDENT (its attention layers run).

        Raises:
            TransitionRefused: a guard refused (e.g. the memory budget).
            TransitionFailed: moving the weights failed and was rolled back.
        """
        self._slot(name).lifecycle.onload()

    def offload(self, name: str) -> None:
        """Move component ``name`` off the device (its attention layers refuse to run).

        Raises:
            TransitionRefused: a guard refused (kept resident, no declared use, in use).
            TransitionFailed: moving the weights failed and was rolled back.
        """
        self._slot(name).lifecycle.offload()

    def release(self, name: str) -> None:
        """Release component ``name``: its module, store and offload file are dropped.

        Raises:
            TransitionRefused: an open request is using it.
        """
        self._slot(name).lifecycle.release()

    def report_cancelled(self, request_id: str) -> None:
        """Log and announce ``request.cancelled`` for a request cancelled before it opened.

        A serving worker calls it for a job that left its queue; a request cancelled
        once open is reported by the orchestrator itself.
        """
        self._stages.cancelled([Left(request_id, (), None, 0)])

    @property
    def waiter(self) -> MemoryWaiter:
        """Return who queues requests waiting for memory (``MemoryWait`` events say how long)."""
        return self._stages.waiter

    def resident_bytes(self) -> int:
        """Return the bytes the resident components hold on the device now."""
        return sum(
            slot.store.resident_bytes() for slot in self._slots.values() if slot.store is not None
        )

    def state(self, name: str) -> ComponentState:
        """Return the state of component ``name``."""
        return self._slot(name).lifecycle.state

    def component(self, name: str) -> ComponentView:
        """Return a read-only view of component ``name``."""
        slot = self._slot(name)
        return ComponentView(
            name=name,
            spec=slot.spec,
            plan=slot.plan,
            state=slot.lifecycle.state,
            in_use_by=tuple(sorted(slot.in_use_by)),
            prefetching=slot.reserved,
            footprint=slot.footprint,
            resident_bytes=0 if slot.store is None else slot.store.resident_bytes(),
        )

    def module(self, name: str) -> nn.Module:
        """Return the module of ``name``: the same object from LOADED until RELEASED.

        Raises:
            LookupError: the component is not loaded.
        """
        slot = self._slot(name)
        if slot.module is None:
            raise LookupError(
                f"component {name!r} has no module in state "
                f"{slot.lifecycle.state.value!r}; load() the pipeline first"
            )
        return slot.module

    def snapshot(self) -> PipelineSnapshot:
        """Return every component's state and plan; encodes to JSON."""
        admission = self._admission
        refusals = () if admission is None else admission.refusals()
        return PipelineSnapshot(
            pipeline=self.spec.name,
            admitted=admission is not None and not refusals,
            components={
                name: ComponentSnapshot(
                    kind=slot.spec.kind,
                    state=slot.lifecycle.state,
                    loader=None if slot.plan is None else slot.plan.loader,
                    residency=slot.spec.residency_mode,
                    attention=() if slot.plan is None else slot.plan.attention,
                    dtype=self.spec.dtype_of(name),
                    bytes=None if slot.plan is None else slot.plan.bytes,
                )
                for name, slot in self._slots.items()
            },
            stages={stage.name: stage.uses for stage in self.spec.stages},
            source=None if isinstance(self.spec.source, UnsetType) else self.spec.source,
            refusals=tuple(
                RefusalReport(
                    component=r.component,
                    trigger="admit",
                    code=r.code,
                    message=r.message,
                    hint=r.hint,
                )
                for r in refusals
            ),
        )

    def close(self) -> None:
        """Release every component it can and remove the offload folder, then report failures.

        Best effort: a failure does not stop the rest.

        Raises:
            ExceptionGroup: one error listing every component that could not be
                released and a folder that could not be removed.
        """
        failures: list[Exception] = []
        with self._machine.lock:
            for slot in self._slots.values():
                if slot.lifecycle.state is not ComponentState.RELEASED:
                    try:
                        slot.lifecycle.release()
                    except Exception as err:  # reported below, after the others are released
                        failures.append(err)
            try:
                self._residency.close()
            except OSError as err:
                failures.append(err)
        if failures:
            raise ExceptionGroup(
                f"closing pipeline {self.spec.name!r} left {len(failures)} failure(s): "
                + "; ".join(str(failure) for failure in failures),
                failures,
            )

    def __enter__(self) -> Orchestrator:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    # -- guards (pure: they read decisions, touch nothing) -------------------

    def _checks(self, name: str) -> dict[str, Check]:
        residency = self._residency

        def admitted(guard: str) -> Check:
            def check(context: TransitionContext) -> tuple[Refusal, ...]:
                if self._admission is None:
                    raise RuntimeError("admit through Orchestrator.admit(), which plans first")
                return self._admission.components[name].refusals[guard]

            return check

        return {
            adm.ATTENTION_PLAN: admitted(adm.ATTENTION_PLAN),
            adm.LOADER_PATH: admitted(adm.LOADER_PATH),
            adm.RESIDENCY_USE: admitted(adm.RESIDENCY_USE),
            adm.BACKENDS_CONSUMABLE: admitted(adm.BACKENDS_CONSUMABLE),
            "world_launched": lambda context: world_refusals(self.spec),
            "plan_honoured": lambda context: self._loading.plan_honoured(name),
            # the guards of every move: bound once, called with no frame of their own
            "memory_budget": partial(residency.memory_budget, name),
            "offloadable": partial(residency.offloadable, name),
            "use_declared": partial(residency.use_declared, name),
            "not_in_use": partial(residency.not_in_use, name),
        }

    # -- work (side effects, each with its undo) ----------------------------

    def _work(self, name: str) -> dict[str, Work]:
        residency = self._residency
        return {
            "load": partial(self._loading.load, name),
            "onload": partial(residency.onload, name),
            "offload": partial(residency.offload, name),
            "release": partial(residency.release, name),
        }

    # -- helpers ---------------------------------------------------------------

    def _report(self, refusals: Sequence[Refusal], *, trigger: str, request_id: str | None) -> None:
        """Log and observe one ``Refused`` per component of ``refusals`` (nothing moved)."""
        for component, found in _by_component(refusals).items():
            slot = self._slots.get(component)  # a request's own refusal names no component
            refused = Refused(
                component=component,
                trigger=trigger,
                source="none" if slot is None else slot.lifecycle.state.value,
                codes=tuple(r.code.value for r in found),
                messages=tuple(r.message for r in found),
                hints=tuple(r.hint for r in found),
                request_id=request_id,
            )
            report_refused(refused, self._observers)

    def _slot(self, name: str) -> ComponentSlot:
        try:
            return self._slots[name]
        except KeyError:
            raise KeyError(
                f"pipeline {self.spec.name!r} has no component {name!r}; "
                f"components: {', '.join(self._slots)}"
            ) from None


def _by_component(refusals: Sequence[Refusal]) -> dict[str, list[Refusal]]:
    grouped: dict[str, list[Refusal]] = {}
    for refusal in refusals:
        grouped.setdefault(refusal.component, []).append(refusal)
    return grouped


def _platform_for(spec: PipelineSpec) -> Platform:
    if spec.device == "auto":
        return Platform.detect()
    return Platform(spec.device)
