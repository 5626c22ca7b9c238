"""The orchestrator: admits a pipeline, loads it, and moves its components.

Decisions come from the pure functions of ``lifecycle.admission``; this
module carries them out on the lifecycle machine, whose guards read those
decisions back and whose work does the side effects (building modules,
arming attention, moving weights) with an undo step for each. The pipeline
itself sleeps, wakes, drains and is released on the pipeline machine
(``lifecycle.machines.pipeline``); several orchestrators on one ``SharedDevice``
share its budget, its line of waiting requests and their equal components.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Collection, Iterator, Sequence
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
from components.compile import Compilation
from components.mesh import ParallelMesh
from components.recipes import Recipe
from components.recipes.base import ENCODE
from lifecycle import admission as adm
from lifecycle.adapters import AdapterKeeper
from lifecycle.admission.adapters import admit_adapter
from lifecycle.admission.folder import open_folder
from lifecycle.device.moves import Residency
from lifecycle.device.pipeline_life import PipelineLife
from lifecycle.device.shared import SharedDevice
from lifecycle.device.sharing import ComponentIdentity, component_identity
from lifecycle.device.slots import ComponentSlot
from lifecycle.device.timeline import Timeline
from lifecycle.device.waiting import MemoryWaiter
from lifecycle.distributed import world_refusals
from lifecycle.events import Event, Observer, Observers, RequestBegan, RequestEnded, TriggerRefused
from lifecycle.loading import Loading
from lifecycle.logs import REQUEST_ID, get_logger
from lifecycle.machines.component import ComponentLifecycle
from lifecycle.machines.engine import Check, MoveArgs, TransitionContext, Work, report_refused
from lifecycle.machines.tables import AdapterState, ComponentState, Guard, PipelineState
from lifecycle.override import BackendSwitch
from lifecycle.plan import (
    AdapterView,
    AdmissionPlan,
    ComponentPlan,
    ComponentSnapshot,
    LoadReport,
    PipelineSnapshot,
    RefusalReport,
)
from lifecycle.prompts import PromptCache, encoders_checksum
from lifecycle.refusals import (
    AdmissionRefused,
    InvalidTransition,
    Refusal,
    RequestRefused,
)
from lifecycle.requests import Request, StageKeeper
from lifecycle.spec.model_ids import source_revision
from lifecycle.spec.reading import load_spec
from lifecycle.spec.structs import AdapterSpec, ComponentSpec, PipelineSpec

__all__ = ["ComponentView", "Orchestrator", "platform_for"]

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
        users: the pipelines holding it (their keys on the device): more than one when
            shared.
    """

    name: str
    spec: ComponentSpec
    plan: ComponentPlan | None
    state: ComponentState
    in_use_by: tuple[str, ...] = ()
    prefetching: bool = False
    footprint: int = 0
    resident_bytes: int = 0
    users: tuple[str, ...] = ()


class Orchestrator:
    """Run the lifecycle of one pipeline and of every component of it.

    Args:
        spec: the decoded pipeline spec.
        platform: where it runs; by default the spec's ``device`` decides.
        observer: receives every event (``lifecycle.events``); ``observe`` attaches more.
        load_threads: the most components ``load()`` builds at once; None: as many as
            may be (see ``load``), up to the CPU count; 1: one at a time, in order.
        shared: the device it shares with other pipelines (a worker's): one budget,
            which replaces the spec's ``memory.device_budget``, one line of waiting
            requests, and equal components held once. By default a device of its own,
            whose budget is the spec's.

    Attributes:
        key: the pipeline's key on its device: its name, unless another pipeline of
            that name is on the device too (``name#2``, during a swap).
    """

    def __init__(
        self,
        spec: PipelineSpec,
        *,
        platform: Platform | None = None,
        observer: Observer | None = None,
        load_threads: int | None = None,
        shared: SharedDevice | None = None,
    ) -> None:
        self.spec = spec
        self.platform = platform or platform_for(spec)
        self.device = torch.device(self.platform.kind)
        self._observers = Observers()
        if observer is not None:
            self._observers.attach(observer)
        self._owns_device = shared is None
        self.shared = _own_device(spec) if shared is None else shared
        timeline = Timeline(spec.stages)
        self.key = self.shared.register(spec.name, timeline, self.platform.kind)
        if shared is not None:
            _note_replaced_budget(spec, shared)
        self._machine = self.shared.machine
        self._admission: adm.Admission | None = None
        self._slots: dict[str, ComponentSlot] = {}
        self._residency = Residency(spec, self._slots, self.device, self.shared, self.key, timeline)
        self._loading = Loading(
            spec, self._slots, self.platform, self._residency, threads=load_threads
        )
        self._adapters = AdapterKeeper(
            self._slots,
            self._residency,
            self.device,
            self._machine.lock,
            self._observers,
            spec.memory.wait_timeout,
            self.key,
        )
        self._stages = StageKeeper(
            self._slots, self._residency, self.shared, self._observers, self._adapters
        )
        self._switch = BackendSwitch(self._slots, self.platform)
        loaders = adm.component_loaders(spec)
        for name, component in spec.components.items():
            lifecycle = ComponentLifecycle(
                name, checks=self._checks(name), work=self._work(name), observers=self._observers
            )
            self._machine.add_component(lifecycle)
            slot = ComponentSlot(name, component, lifecycle, loaders[name], self.key)
            self._slots[name] = slot
            self.shared.add_slot(slot)
        self._life = PipelineLife(
            spec.name,
            self.key,
            self.shared,
            self._slots,
            self._observers,
            spec.serving.drain_timeout,
        )
        self.recipe: Recipe | None = (
            None if isinstance(spec.source, UnsetType) else open_folder(spec, loaders).recipe
        )
        """How a request runs the stages of a pipeline from a folder (its pipeline class's
        recipe, on the components' loaders); None for a pipeline of kinds, whose stages
        each kind runs itself, and for a folder admission refuses."""
        for name, adapter in spec.adapters.items():
            self._adapters.add(name, adapter)
        self._stages.prompts = self._prompt_cache(timeline)

    @classmethod
    def from_file(
        cls,
        path: str | Path,
        *,
        platform: Platform | None = None,
        observer: Observer | None = None,
        load_threads: int | None = None,
        shared: SharedDevice | None = None,
    ) -> Orchestrator:
        """Decode the spec at ``path`` and build its orchestrator (arguments as for the class).

        Raises:
            ConfigError: the spec is missing or bad.
        """
        return cls(
            load_spec(path),
            platform=platform,
            observer=observer,
            load_threads=load_threads,
            shared=shared,
        )

    # -- the public surface -------------------------------------------------

    def observe(self, observer: Observer) -> Callable[[], None]:
        """Hand every event from now on to ``observer`` too; return the call that stops it.

        Events (``lifecycle.events``) arrive on the thread that caused them, often
        with the orchestrator's lock held: an observer returns quickly. One that
        raises is logged and skipped; it never changes what the orchestrator does.
        """
        return self._observers.attach(observer)

    def announce(self, event: Event) -> None:
        """Hand ``event`` to this pipeline's observers: what a worker did with the pipeline
        (``PipelineSwapped``, ``PipelineReloaded``, ``PipelineRestored``)."""
        if self._observers.attached:
            self._observers.emit(event)

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
            admission = adm.admit_pipeline(
                self.spec,
                self.platform,
                loaders,
                None if self._owns_device else self._life.admission_budget(),
                served=self.shared.serves,
            )
            self._admission = admission
            for name, slot in self._slots.items():
                slot.admission = admission.components[name]
            refusals = admission.refusals()
            if refusals:
                self._report(refusals, trigger="admit", request_id=None)
                raise AdmissionRefused(self.spec.name, refusals)
            for slot in self._slots.values():
                slot.lifecycle.admit()
            for name, adapter in admission.adapters.items():
                self._adapters.admit(name, adapter)
            return AdmissionPlan(
                pipeline=self.spec.name,
                platform=self.platform.kind,
                components={name: slot.plan for name, slot in self._slots.items() if slot.plan},
            )

    def load(self) -> LoadReport:
        """Load every admitted component and put it in its initial place; say how long it took.

        Resident components end RESIDENT, offloaded ones OFFLOADED (all of them while
        the pipeline sleeps; ``wake`` onloads the resident ones). Admits first when that
        has not happened. On a shared device, a component equal to one another pipeline
        loaded (``lifecycle.device.sharing``) is not loaded again: the pipeline uses that one.
        Components are built in parallel threads where that changes nothing but the
        time: in one process, with weights from a file or a seed, and not offloaded to
        disk (the host memory check counts those one at a time). Their transitions
        still run in order under the machine's lock, each taking its component's build,
        as a sequential load does.

        Raises:
            AdmissionRefused: admission was needed and refused.
            TransitionRefused: the layout's world size differs from the launched one.
            TransitionFailed: a component failed to load; it stays ADMITTED, and so do
                the components after it.
        """
        started = time.perf_counter()
        placed: dict[str, float] = {}
        with self._machine.lock:
            if self._admission is None or not self._admission.admitted:
                self.admit()
            admitted = [
                name
                for name, slot in self._slots.items()
                if slot.lifecycle.state is ComponentState.ADMITTED
            ]
            parallel = self._loading.parallel_builds(admitted)
            self._loading.build_ahead(parallel)
            try:
                for name in list(self._slots):
                    slot = self._slots[name]
                    if slot.lifecycle.state is ComponentState.ADMITTED:
                        slot = self._load_or_share(name, slot)
                    if slot.lifecycle.state is ComponentState.LOADED:
                        placing = time.perf_counter()
                        if self.shared.is_asleep(self.key):
                            slot.lifecycle.offload(MoveArgs(sleeping=True))
                        elif slot.spec.residency_mode is ResidencyMode.RESIDENT:
                            slot.lifecycle.onload()
                        else:
                            slot.lifecycle.offload()
                        placed[name] = (time.perf_counter() - placing) * 1e3
            finally:
                self._loading.discard_ahead()  # also a build a shared component made needless
            for name, adapter in self._adapters.adapters.items():
                if adapter.lifecycle.state is AdapterState.ADMITTED:
                    self._adapters.load(name)
        built = {name: self._loading.build_ms.get(name, 0.0) for name in admitted}
        return LoadReport(
            duration_ms=round((time.perf_counter() - started) * 1e3, 3),
            components={name: round(built.get(name, 0.0) + placed[name], 3) for name in placed},
            parallel=tuple(parallel),
        )

    @property
    def pipeline_state(self) -> PipelineState:
        """Return where the pipeline stands: serving, sleeping, swapping, draining or
        released."""
        return self._life.state

    def sleep(self, timeout: float | None = None) -> None:
        """Put the pipeline to sleep: every component it does not share with a pipeline
        that is awake leaves the device (also those kept resident), and stays off until
        ``wake``.

        Open requests of the pipeline are waited for, up to ``timeout`` seconds
        (``serving.drain_timeout`` by default), never cut.

        Raises:
            InvalidTransition: the pipeline is not serving (asleep already, draining).
            TransitionRefused: requests were still open after ``timeout``; nothing moved.
            TransitionFailed: an offload failed; what moved was put back.
        """
        self._life.sleep(timeout)

    def wake(self) -> None:
        """Wake the pipeline: its components go back where ``load`` put them.

        Raises:
            InvalidTransition: the pipeline does not sleep.
            TransitionRefused: its resident components cannot fit the budget beside
                what other pipelines keep resident.
            TransitionFailed: an onload failed or was refused (other requests hold the
                device); the pipeline still sleeps, nothing moved.
        """
        self._life.wake()

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
        (design §4.6); it is validated and prepared before the request opens.
        ``priority`` orders its stages among those waiting for memory (higher first,
        with ageing: ``lifecycle.device.waiting``). ``request.cancel()`` stops it from any
        thread (design §15).

        Raises:
            ValueError: a request with that id is already open.
            RequestRefused: ``attention_backend`` breaks a rule; nothing was switched.
        """
        rid = request_id or self.shared.next_request_id()
        if attention_backend is not None:
            try:
                self._switch.prepare(attention_backend)
            except RequestRefused as err:
                self._report(err.refusals, trigger="request", request_id=rid)
                raise
        self.shared.open_request(rid, self.key)
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
                        cache=request.cache_steps,
                        prompts=request.prompts,
                    )
                    if is_logged:
                        # a request that ran a step cache says what it skipped (design §17)
                        cached = (
                            {
                                "cache": msgspec.to_builtins(ended.cache),
                                "cache_skipped": ended.cache_skipped,
                                "cache_uncached": sum(c.uncached for c in ended.cache.values()),
                            }
                            if ended.cache
                            else {}
                        )
                        log.info(
                            "request.end",
                            request_id=rid,
                            duration_ms=ended.duration_ms,
                            stages=list(ended.stages),
                            **cached,
                        )
                    observers.emit(ended)
        finally:
            REQUEST_BACKEND.reset(backend)
            REQUEST_ID.reset(token)

    def adapters(self) -> list[AdapterView]:
        """Return a view of every adapter, by name (design §14)."""
        with self._machine.lock:
            return self._adapters.views()

    @property
    def adapter_switches(self) -> int:
        """Return how often a request switched the adapters merged into a component."""
        return self._adapters.switches

    def add_adapter(self, name: str, adapter: AdapterSpec) -> AdapterView:
        """Admit and load adapter ``name`` into the loaded pipeline; return its view.

        Raises:
            ValueError: ``name`` is taken (an adapter or a component has it).
            LookupError: the pipeline is not loaded.
            TransitionRefused: admission refused it (``adapter.*`` codes); nothing stays.
            TransitionFailed: its matrices could not be read; nothing stays.
        """
        with self._machine.lock:
            admission = self._admission
            if admission is None or any(s.module is None for s in self._slots.values()):
                raise LookupError(f"pipeline {self.spec.name!r} is not loaded; load() it first")
            if name in self._adapters.adapters or name in self._slots:
                raise ValueError(f"adapter name {name!r} is taken; choose another")
            paths = {c: a.plan.loader for c, a in admission.components.items()}
            builders = {c: slot.loaded_module for c, slot in self._slots.items()}
            admitted = admit_adapter(name, adapter, self.spec, paths, builders)
            self._adapters.add(name, adapter)
            try:
                self._adapters.admit(name, admitted)
                self._adapters.load(name)
            except BaseException:
                self._adapters.remove(name)
                raise
            return next(view for view in self._adapters.views() if view.name == name)

    def remove_adapter(self, name: str) -> None:
        """Unmerge or detach adapter ``name`` (after the requests using its component), release it.

        Raises:
            KeyError: no adapter has that name.
            TransitionRefused: requests used its component past ``memory.wait_timeout``.
        """
        self._adapters.remove(name)

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
        """Return the bytes the pipeline's resident components hold on the device now."""
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
            users=tuple(sorted(slot.users)),
        )

    def compilations(self) -> dict[str, Compilation]:
        """Return what torch.compile did for each loaded compiled component (design §17):
        graphs compiled, recompiles after its first forward, seconds inductor took."""
        return {
            name: slot.compilation
            for name, slot in self._slots.items()
            if slot.compilation is not None
        }

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
                    users=tuple(sorted(slot.users)),
                    cache=None
                    if slot.spec.cache_settings is None
                    else slot.spec.cache_settings.resolved(),
                    compile=slot.spec.compile_mode,
                    quantization=slot.spec.quantization_mode,
                )
                for name, slot in self._slots.items()
            },
            stages={stage.name: stage.uses for stage in self.spec.stages},
            source=None if isinstance(self.spec.source, UnsetType) else self.spec.source,
            revision=None
            if isinstance(self.spec.source, UnsetType)
            else source_revision(self.spec.source),
            adapters=tuple(self._adapters.views()),
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
        """Drain the pipeline, release every component it can, remove the offload folder,
        then report failures.

        Best effort: a failure does not stop the rest. A component another pipeline
        still shares stays loaded for it. Once everything is released, the pipeline is
        RELEASED; closing again is harmless.

        Raises:
            ExceptionGroup: one error listing every component that could not be
                released and a folder that could not be removed.
        """
        failures: list[Exception] = []
        with self._machine.lock:
            for name in list(self._adapters.adapters):
                try:
                    self._adapters.remove(name)
                except Exception as err:  # reported below, after the others are released
                    failures.append(err)
            if self._life.is_staying:
                self._life.drain()
            for slot in self._slots.values():
                try:
                    self._life.let_go(slot)
                except Exception as err:  # reported below, after the others are released
                    failures.append(err)
            try:
                self._residency.close()
            except OSError as err:
                failures.append(err)
            if not failures:
                self._life.release()
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

    # -- sharing ---------------------------------------------------------------

    def _load_or_share(self, name: str, slot: ComponentSlot) -> ComponentSlot:
        """Load ``name``, or use the equal component another pipeline on the device loaded.

        A device of its own has no other pipeline: nothing to compare, no file read.
        """
        if self._owns_device:
            slot.lifecycle.load()
            return slot
        try:
            identity = component_identity(slot, self.spec, self.platform.kind)
        except (OSError, ValueError):  # an unreadable weights file: its load says why
            slot.lifecycle.load()
            return slot
        found = self.shared.loaded_equal(identity)
        if found is None or self.key in found.users:
            slot.lifecycle.load()
            slot.identity = identity
            self.shared.offer(identity, slot)
            return slot
        self.shared.drop_slot(slot)
        self._slots[name] = found
        self.shared.join(found, self.key, name, self._observers)
        return found

    def _prompt_cache(self, timeline: Timeline) -> PromptCache | None:
        """Return the pipeline's prompt cache: for a folder's encode stage, where
        ``serving.prompt_cache_bytes`` gives it room (design §19)."""
        capacity = self.spec.serving.prompt_cache
        stage = next((s for s in timeline.stages if s.name == ENCODE), None)
        if self.recipe is None or not capacity or stage is None:
            return None
        checksum = partial(
            encoders_checksum, self._slots, stage.uses, self.spec, self.platform.kind
        )
        return PromptCache(capacity, stage.name, stage.uses, checksum)

    def identities(self) -> dict[str, ComponentIdentity]:
        """Return what makes each admitted component itself (``lifecycle.device.sharing``), by name.

        Reads each weights file to checksum it. A swap compares the new pipeline's with
        the old one's to keep what they share loaded.

        Raises:
            RuntimeError: the pipeline was never admitted.
            OSError, ValueError: a weights file cannot be read.
        """
        return {
            name: slot.identity or component_identity(slot, self.spec, self.platform.kind)
            for name, slot in self._slots.items()
        }

    def begin_swap(self) -> None:
        """Mark the pipeline SWAPPING: a new pipeline of its name takes over (a worker's
        swap or reload); it drains next.

        Raises:
            InvalidTransition: it is neither serving nor sleeping.
        """
        self._life.begin_swap()

    def drain(self) -> None:
        """Mark the pipeline DRAINING: it is on its way out (a worker sends it nothing new).

        Its explicitly resident components no longer count against other pipelines'
        admission: they leave with it.

        Raises:
            InvalidTransition: it drains already, or was released.
        """
        self._life.drain()

    def release_unshared(self, keep: Collection[ComponentIdentity]) -> None:
        """Release the components of a draining pipeline, but those whose identity is in
        ``keep`` (those its successor in a swap will share); ``close`` releases the rest.

        Raises:
            InvalidTransition: the pipeline is not draining.
            TransitionRefused: an open request still uses a component; the others were
                released.
        """
        self._life.release_unshared(keep)

    # -- guards (pure: they read decisions, touch nothing) -------------------

    def _checks(self, name: str) -> dict[Guard, Check]:
        """Bind each guard of the component table to what decides it for ``name``:
        admission's findings, the launched world, the loading, the device."""
        residency = self._residency

        def admitted(guard: Guard) -> Check:
            def check(context: TransitionContext) -> tuple[Refusal, ...]:
                if self._admission is None:
                    raise RuntimeError("admit through Orchestrator.admit(), which plans first")
                return self._admission.components[name].refusals[guard]

            return check

        return {
            Guard.ATTENTION_PLAN: admitted(Guard.ATTENTION_PLAN),
            Guard.LOADER_PATH: admitted(Guard.LOADER_PATH),
            Guard.RESIDENCY_USE: admitted(Guard.RESIDENCY_USE),
            Guard.BACKENDS_CONSUMABLE: admitted(Guard.BACKENDS_CONSUMABLE),
            Guard.WORLD_LAUNCHED: lambda context: world_refusals(self.spec),
            Guard.PLAN_HONOURED: lambda context: self._loading.plan_honoured(name),
            # the guards of every move: bound once, called with no frame of their own
            Guard.PIPELINE_AWAKE: partial(residency.pipeline_awake, name),
            Guard.MEMORY_BUDGET: partial(residency.budget.memory_budget, self._slots, name),
            Guard.OFFLOADABLE: partial(residency.offloadable, name),
            Guard.USE_DECLARED: partial(residency.use_declared, name),
            Guard.NOT_IN_USE: partial(residency.not_in_use, name),
        }

    # -- work (side effects, each with its undo) ----------------------------

    def _work(self, name: str) -> dict[str, Work]:
        """Bind each trigger of ``name`` that has work to what does it: the loading builds,
        ``Residency`` moves the weights through the component's store."""
        residency = self._residency
        return {
            "load": partial(self._loading.load, name),
            "onload": partial(residency.onload, name),
            "offload": partial(residency.offload, name),
            "release": partial(residency.release, name),
        }

    # -- helpers ---------------------------------------------------------------

    def _report(self, refusals: Sequence[Refusal], *, trigger: str, request_id: str | None) -> None:
        """Log and observe one ``TriggerRefused`` per component of ``refusals`` (nothing moved)."""
        for component, found in _by_component(refusals).items():
            slot = self._slots.get(component)  # a request's own refusal names no component
            refused = TriggerRefused(
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


def _own_device(spec: PipelineSpec) -> SharedDevice:
    """Return a device for ``spec`` alone, under its ``memory.device_budget``."""
    budget = spec.memory.device_budget
    return SharedDevice(device_budget=None if isinstance(budget, msgspec.UnsetType) else budget)


def _note_replaced_budget(spec: PipelineSpec, shared: SharedDevice) -> None:
    """Say (a warning) that the device's shared budget replaces the spec's own."""
    own = spec.memory.device_budget
    if not isinstance(own, msgspec.UnsetType) and own != shared.budget.limit:
        log.warning(
            "lifecycle.budget_replaced",
            pipeline=spec.name,
            spec_budget=int(own),
            device_budget=shared.budget.limit,
            key=shared.budget.key,
        )


def platform_for(spec: PipelineSpec) -> Platform:
    """Return the platform ``spec``'s ``device`` asks for (``auto``: CUDA where present)."""
    if spec.device == "auto":
        return Platform.detect()
    return Platform(spec.device)
