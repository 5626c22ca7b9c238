"""Requests and their stages: in-use counts, onload before a stage, offload after last use."""

from __future__ import annotations

import threading
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager

import torch
from torch import nn

from components import ResidencyMode
from components.adapters import batch_rows
from components.batch import Batch, Cancelled, Left
from components.cache import CacheSteps, count_steps
from components.recipes import Recipe
from lifecycle.adapters import AdapterKeeper, Rows
from lifecycle.admission.prefetch import AheadStage, plan_prefetch
from lifecycle.device.moves import Residency
from lifecycle.device.shared import SharedDevice
from lifecycle.device.slots import ComponentSlot
from lifecycle.device.waiting import WaitTerms
from lifecycle.events import Observers, PromptCounts, RequestCancelled
from lifecycle.logs import get_logger
from lifecycle.machines.engine import MoveArgs
from lifecycle.machines.tables import ComponentState
from lifecycle.prompts import PromptCache, counted
from lifecycle.refusals import TransitionFailed, TransitionRefused
from lifecycle.spec.structs import StageSpec

__all__ = ["Request", "StageKeeper"]

log = get_logger("lifecycle")

_RESIDENT = ComponentState.RESIDENT
_OFFLOADED = ComponentState.OFFLOADED


class StageKeeper:
    """Move components in and out around the stages of every open request.

    A component is in use while an open request's stage uses it; it is
    onloaded before such a stage and, once idle, offloaded per its mode after
    its last use in the timeline. Stages of one component that follow each
    other share one interval on the device.

    Args:
        slots: the orchestrator's components by name.
        residency: what moves weights (and prefetches the next stage's).
        shared: the device: its lock, held while counts and states change together,
            its open requests and its line of requests waiting for memory.
        observers: who hears of every wait for memory.
        adapters: the pipeline's adapters: a stage's components get the merged adapters
            its rows name before they are used.

    Attributes:
        prompts: the pipeline's prompt cache, which stands in for its encode stage when
            it holds every row's text (``lifecycle.prompts``); None without one.
    """

    def __init__(
        self,
        slots: Mapping[str, ComponentSlot],
        residency: Residency,
        shared: SharedDevice,
        observers: Observers,
        adapters: AdapterKeeper,
    ) -> None:
        self.slots = slots
        self.adapters = adapters
        # each open request's rows of adapters for the stage it enters (see Request.run)
        self.rows: dict[str, Rows | None] = {}
        self.residency = residency
        self.timeline = residency.timeline
        self.lock = shared.lock
        self.observers = observers
        self.shared = shared
        self.waiter = shared.waiter
        self.terms = WaitTerms(residency.spec.memory.wait_timeout, observers, slots)
        self.prompts: PromptCache | None = None
        # what each request holds in a stage with step windows, by (request, position)
        self._holding: dict[tuple[str, int], tuple[str, ...]] = {}
        # the onload of the next request's first expert each request started, and the
        # components onloaded so for a next request that has not used them yet
        self._ahead: dict[str, threading.Thread] = {}
        self._prefetched: set[str] = set()

    def enter(
        self, request_id: str, position: int, priority: int, check: Callable[[], object]
    ) -> dict[str, nn.Module]:
        """Use the stage's components for ``request_id`` and make them resident.

        While other requests use the memory it needs it waits its turn, by priority
        with ageing (``lifecycle.device.waiting``); ``check`` raises ``Cancelled`` to stop
        waiting.

        Raises:
            TransitionRefused: an onload was refused (e.g. the memory budget, also
                after ``memory.wait_timeout``); nothing stays in use.
            TransitionFailed: an onload failed; nothing stays in use.
            Cancelled: the request was cancelled while it waited; nothing is in use.
        """
        with self.lock:
            stage = self.timeline.stages[position]
            if stage.windows:  # it waits for what it holds on entry, one windowed use
                stage = StageSpec(name=stage.name, uses=self.timeline.entered(position))
            return self.waiter.acquire(
                request_id,
                position,
                stage,
                self._use,
                self.leave,
                self.terms,
                priority=priority,
                check=check,
            )

    def hand_over(
        self,
        request_id: str,
        position: int,
        name: str,
        priority: int,
        check: Callable[[], object],
    ) -> dict[str, nn.Module]:
        """Hand ``request_id``'s stage at ``position`` over to its windowed use ``name``:
        let go of the windowed use it holds (put back after its last use, as a stage's end
        puts it back), then use and onload ``name`` as ``enter`` does (waiting its turn);
        return ``name``'s module.

        Raises:
            TransitionRefused, TransitionFailed, Cancelled: as ``enter``; the request then
                holds the stage's other uses alone.
        """
        key = (request_id, position)
        with self.lock:
            stage = self.timeline.stages[position]
            held = self._holding.get(key, self.timeline.entered(position))
            given = tuple(n for n in held if n in stage.windows)
            self._holding[key] = tuple(n for n in held if n not in stage.windows)
            self._drop(request_id, given)
            try:
                last = self.timeline.last_uses(position)
                self._put_back([n for n in given if n in last], request_id)
            finally:
                self.waiter.released()
            return self.waiter.acquire(
                request_id,
                position,
                StageSpec(name=stage.name, uses=(name,)),
                lambda rid, at: self._use(rid, at, (name,)),
                lambda rid, at: self._let_go(rid, at, (name,)),
                self.terms,
                priority=priority,
                check=check,
            )

    def cancelled(self, left: Sequence[Left]) -> None:
        """Log and announce ``request.cancelled`` for each cancellation in ``left``."""
        for request_id, _, stage, step in left:
            log.info("request.cancelled", request_id=request_id, stage=stage, step=step)
            if self.observers.attached:
                self.observers.emit(RequestCancelled(request_id=request_id, stage=stage, step=step))

    def _use(
        self, request_id: str, position: int, uses: tuple[str, ...] | None = None
    ) -> dict[str, nn.Module]:
        """Mark ``uses`` (by default what the stage holds on entry) in use and onload them,
        or (raising) leave none of them in use.

        Runs inside ``enter`` and ``hand_over``, under the lock.
        """
        entering = uses is None
        if uses is None:
            uses = self.timeline.entered(position)
        slots = self.slots
        if self.adapters.adapters:
            self.adapters.settle(uses, self.rows.get(request_id), request_id)
        self._prefetched.difference_update(uses)
        for name in uses:
            in_use_by = slots[name].in_use_by
            in_use_by[request_id] = in_use_by.get(request_id, 0) + 1
        if self.timeline.stages[position].windows:
            key = (request_id, position)
            self._holding[key] = (*self._holding.get(key, ()), *uses)
        try:
            for name in uses:
                lifecycle = slots[name].lifecycle
                if lifecycle.state is not _RESIDENT:
                    lifecycle.onload(MoveArgs(position=position, request_id=request_id))
            if entering and self.residency.prefetches:
                self.residency.prefetch(self.timeline.added_next(position))
            first = self.timeline.first_expert
            if entering and first is not None and position == len(self.timeline.stages) - 1:
                self._prefetch_next(request_id, position, *first)
            return {name: slots[name].loaded_module() for name in uses}
        except BaseException:
            self._let_go(request_id, position, uses)
            raise

    def _prefetch_next(self, request_id: str, position: int, at: int, name: str) -> None:
        """Start onloading ``name``, the first expert of the stage at ``at``, for the next
        request while ``request_id`` runs its last stage (at ``position``), where
        ``plan_prefetch`` says it pays; else say why (``residency.prefetch_skipped``).

        Runs under the lock; the onload runs on a thread of its own, so that it overlaps
        the stage, and ``finish`` waits for it.
        """
        slot = self.slots[name]
        budget = self.residency.budget
        key = self.residency.key
        eviction = MoveArgs(eviction=True)
        pinned = {o for o in budget.charged if o is not slot and not o.may_be_evicted}
        kept = {
            o for o in budget.charged if o is not slot and not o.lifecycle.offload.may(eviction)
        }
        ahead = [
            AheadStage(
                name=self.timeline.stages[p].name,
                held={
                    n: self.slots[n].footprint
                    for n in self.timeline.entered(p)
                    if n != name and self.slots[n] not in pinned
                },
            )
            for p in range(at)
        ]
        decision = plan_prefetch(
            name,
            offloaded=slot.lifecycle.state is _OFFLOADED,
            streams_blocks=slot.mode is ResidencyMode.LAYERWISE_OFFLOAD,
            needed=slot.footprint,
            budget=budget.limit,
            kept={o.label(key): budget.charged[o] for o in kept | pinned},
            pinned={o.label(key): budget.charged[o] for o in pinned},
            ahead=ahead,
            waiting=bool(self.waiter.wanted()),
            budget_key=budget.key,
        )
        if not decision.prefetch:
            log.debug(
                "residency.prefetch_skipped",
                component=name,
                request_id=request_id,
                reason=decision.reason,
            )
            return
        thread = threading.Thread(
            target=self._onload_ahead,
            args=(request_id, position, name),
            name=f"lifecycle-prefetch-{name}",
            daemon=True,
        )
        self._ahead[request_id] = thread
        thread.start()

    def _onload_ahead(self, request_id: str, position: int, name: str) -> None:
        """Onload ``name`` for the next request (``residency.moved`` with reason
        ``prefetch``), unless something onloaded it first; a refusal or failure leaves it
        offloaded and is said at debug level."""
        lifecycle = self.slots[name].lifecycle
        try:
            with self.lock:
                if lifecycle.state is _OFFLOADED:
                    args = MoveArgs(position=position, request_id=request_id, reason="prefetch")
                    lifecycle.onload(args)
                    self._prefetched.add(name)
        except (TransitionRefused, TransitionFailed) as err:
            log.debug(
                "residency.prefetch_skipped", component=name, request_id=request_id, reason=str(err)
            )

    def leave(self, request_id: str, position: int) -> None:
        """End ``request_id``'s use of the stage; offload what saw its last use."""
        held = self._holding.pop((request_id, position), None)
        self._let_go(
            request_id, position, self.timeline.entered(position) if held is None else held
        )

    def _let_go(self, request_id: str, position: int, uses: tuple[str, ...]) -> None:
        """End ``request_id``'s use of ``uses`` in the stage at ``position``; offload what
        saw its last use."""
        with self.lock:
            self._drop(request_id, uses)
            held = self._holding.get((request_id, position))
            if held is not None:
                self._holding[(request_id, position)] = tuple(n for n in held if n not in uses)
            try:
                self._put_back(self.timeline.last_uses(position), request_id)
            finally:
                self.waiter.released()  # what the request used is free, put back or not
                self.adapters.released()

    def _drop(self, request_id: str, uses: Iterable[str]) -> None:
        """Count one use fewer of each of ``uses`` by ``request_id`` (under the lock)."""
        slots = self.slots
        for name in uses:
            in_use_by = slots[name].in_use_by
            left = in_use_by.get(request_id, 0) - 1
            if left > 0:
                in_use_by[request_id] = left
            else:
                in_use_by.pop(request_id, None)

    def finish(self, request_id: str, touched: set[str]) -> None:
        """End ``request_id``: wait for the onload it started for the next request, then put
        every component it touched back where its plan says (but what that onload brought
        in, which waits for the next request)."""
        ahead = self._ahead.pop(request_id, None)
        if ahead is not None:
            ahead.join()
        with self.lock:
            self.shared.close_request(request_id)  # a sleep or a drain may wait for it
            self.rows.pop(request_id, None)
            try:
                self.residency.cancel_prefetch(touched)
                self._put_back(sorted(touched - self._prefetched), request_id)
            finally:
                self.waiter.released()

    def _put_back(self, names: Iterable[str], request_id: str) -> None:
        wanted = self.waiter.wanted()
        for name in names:
            if self._is_left_on(name) and (not wanted or self.slots[name] not in wanted):
                self.slots[name].lifecycle.offload(MoveArgs(request_id=request_id))

    def _is_left_on(self, name: str) -> bool:
        """Tell whether ``name`` is resident, idle, and not resident by mode: to put back."""
        slot = self.slots[name]
        return (
            not slot.in_use_by
            and slot.lifecycle.state is _RESIDENT
            and slot.mode is not ResidencyMode.RESIDENT
        )


class Request:
    """One request moving through the pipeline's stages (``Orchestrator.request``).

    Args:
        keeper: what moves the components around its stages.
        request_id: its id.
        priority: its place when stages wait for memory.
        recipe: what runs a stage of a pipeline from a folder; None: each component's
            kind runs itself.

    Attributes:
        id: the request's id, on every event it causes.
        priority: its place when stages wait for memory (higher first, with ageing).
        stages: the stages it entered, in order.
        cache_steps: each component with a step cache: the image steps it computed and
            skipped for this request's rows (rows cancelled meanwhile leave uncounted).
        prompts: the rows the prompt cache answered and those encoded; None where the
            pipeline has no prompt cache.
    """

    def __init__(
        self,
        keeper: StageKeeper,
        request_id: str,
        priority: int = 0,
        recipe: Recipe | None = None,
    ) -> None:
        self.id = request_id
        self.priority = priority
        self.stages: list[str] = []
        self.touched: set[str] = set()
        self.cache_steps: dict[str, CacheSteps] = {}
        self.prompts = None if keeper.prompts is None else PromptCounts()
        self._keeper = keeper
        self._recipe = recipe
        self._cancelled = False
        self._batch: Batch | None = None
        # one inference-mode guard for every stage: a request runs its stages one at a
        # time, and building the guard is half of what entering it costs
        self._inference = torch.inference_mode()

    def cancel(self) -> None:
        """Cancel the request, from any thread: it stops before its next denoising step.

        A stage waiting for memory stops waiting; a running stage stops after the
        step it is in (kinds that step through ``Batch.stepped``) and puts its
        components back by the ordinary moves; a later stage does not start. The
        stage raises ``components.batch.Cancelled``, and ``request.cancelled`` is
        logged with the stage and step reached.
        """
        self._cancelled = True
        batch = self._batch
        if batch is not None:
            batch.cancellation.cancel(self.id)
        self._keeper.waiter.wake()

    @property
    def is_cancelled(self) -> bool:
        """Tell whether ``cancel()`` was called."""
        return self._cancelled

    @contextmanager
    def stage(self, name: str) -> Iterator[Mapping[str, nn.Module]]:
        """Run one stage: yield its components' modules, resident and armed (with step
        windows, one windowed use at a time: ``HandingOver``).

        Raises:
            KeyError: no stage has that name.
            TransitionRefused: a component could not be onloaded (budget).
            Cancelled: the request was cancelled; nothing was entered.
        """
        check = self._check_cancelled(name)
        position, modules = self._enter(name, check)
        try:
            yield self._handing_over(position, modules, check)
        finally:
            self._keeper.leave(self.id, position)

    def run(self, stage: str, batch: Batch) -> None:
        """Run one stage on what ``batch`` carries: the recipe's stage for a pipeline from a
        folder, else each component's kind in turn.

        Rows cancelled through ``batch.cancellation`` leave before the stage and
        between its denoising steps; when none is left the stage raises ``Cancelled``.
        Where the prompt cache holds every row's text, the encode stage is not entered:
        the text comes from the cache, and no encoder is used.

        Raises:
            NotImplementedError: a component's kind does not say how it runs.
            ValueError: the batch asks a recipe for what its pipeline class cannot do.
            Cancelled: every row of ``batch`` was cancelled, or the request was.
        """
        # the body of ``stage()`` inlined: a generator context manager per stage is a
        # measurable part of a move's cost (issue 12)
        reported = len(batch.left)
        batch.stage, batch.step = stage, 0
        self._batch = batch
        try:
            if self._cancelled:
                batch.cancellation.cancel(self.id)
            keeper = self._keeper
            if batch.adapters is not None or keeper.adapters.adapters:
                keeper.adapters.check_rows(batch.adapters or ())
                keeper.rows[self.id] = batch.adapters
            prompts = keeper.prompts if self._recipe is not None else None
            keys = None
            if prompts is not None and stage == prompts.stage:
                assert self._recipe is not None  # prompts is None without one
                keys = prompts.keys(self._recipe, batch, keeper.adapters)
                if prompts.restore(keys, batch):
                    self.prompts = counted(batch.size, 0, self.prompts)
                    batch.drop_cancelled()
                    return
            with self._inference:
                position, entered = self._enter(stage, batch.drop_cancelled)
                modules = self._handing_over(position, entered, batch.drop_cancelled)
                try:
                    slots = keeper.slots
                    with batch_rows(batch):
                        if self._recipe is not None:
                            self._recipe.run(stage, modules, batch)
                        else:
                            for name, module in modules.items():
                                slots[name].loader.run(module, batch)
                finally:
                    self._keeper.leave(self.id, position)
                self._count_cache(position, batch)
                if keys is not None:
                    assert prompts is not None  # keys come from it
                    prompts.keep(keys, batch)
                    self.prompts = counted(0, batch.size, self.prompts)
                batch.drop_cancelled()  # what was cancelled during the stage leaves now
        finally:
            self._batch = None
            if len(batch.left) > reported:
                self._keeper.cancelled(batch.left[reported:])

    def _count_cache(self, position: int, batch: Batch) -> None:
        """Add the steps the stage's cached component computed and skipped for ``batch``."""
        if batch.cache_rows is None:
            return
        slots = self._keeper.slots
        for name in self._keeper.timeline.stages[position].uses:
            if slots[name].spec.cache_settings is not None:
                counted = count_steps(batch.cache_rows)
                self.cache_steps[name] = self.cache_steps.get(name, CacheSteps()) + counted
                return

    def run_all(self, batch: Batch) -> None:
        """Run every stage of the pipeline on ``batch``, in declared order.

        Raises:
            NotImplementedError: a component's kind does not say how it runs.
            Cancelled: every row of ``batch`` was cancelled, or the request was.
        """
        for stage in self._keeper.timeline.stages:
            self.run(stage.name, batch)

    def _check_cancelled(self, stage: str) -> Callable[[], None]:
        """Return the check that stops stage ``stage`` of a request run without a batch."""

        def check() -> None:
            if self._cancelled:
                self._keeper.cancelled([Left(self.id, (), stage, 0)])
                raise Cancelled(stage, 0)

        return check

    def _handing_over(
        self, position: int, modules: dict[str, nn.Module], check: Callable[[], object]
    ) -> Mapping[str, nn.Module]:
        """Return the modules of the stage at ``position`` as its body may ask for them:
        ``modules``, or where its uses have step windows, a ``HandingOver`` of them."""
        windows = self._keeper.timeline.stages[position].windows
        if not windows:
            return modules
        keeper = self._keeper
        return HandingOver(
            modules,
            windows,
            lambda name: keeper.hand_over(self.id, position, name, self.priority, check),
        )

    def _enter(self, name: str, check: Callable[[], object]) -> tuple[int, dict[str, nn.Module]]:
        """Use the stage ``name`` and onload its components; return its position and modules.

        ``check`` raises ``Cancelled`` when the request must not go on; it is asked
        before anything is held and while the stage waits for memory.
        """
        timeline = self._keeper.timeline
        position = timeline.index(name)
        check()
        self.touched.update(timeline.stages[position].uses)
        self.touched.update(timeline.added_next(position))
        modules = self._keeper.enter(self.id, position, self.priority, check)
        self.stages.append(name)
        return position, modules


class HandingOver(Mapping[str, nn.Module]):
    """The modules of a stage whose uses have step windows, as its body asks for them.

    The stage holds one windowed use at a time; asking for another hands the stage over
    to it (``StageKeeper.hand_over``): the one held is let go, then the one asked for is
    onloaded. A denoiser that asks for its experts in timestep order (Wan 2.2 A14B's
    ``transformer``, then ``transformer_2``) hands over once per request.

    Args:
        modules: what the stage holds on entry.
        windows: its windowed uses.
        hand_over: hands the stage over to a windowed use; returns its module by name.
    """

    def __init__(
        self,
        modules: dict[str, nn.Module],
        windows: Collection[str],
        hand_over: Callable[[str], dict[str, nn.Module]],
    ) -> None:
        self._modules = modules
        self._windows = windows
        self._hand_over = hand_over

    def __getitem__(self, name: str) -> nn.Module:
        module = self._modules.get(name)
        if module is not None:
            return module
        if name not in self._windows:
            raise KeyError(name)
        kept = {n: m for n, m in self._modules.items() if n not in self._windows}
        self._modules = kept | self._hand_over(name)
        return self._modules[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._modules)

    def __len__(self) -> int:
        return len(self._modules)
