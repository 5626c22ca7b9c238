"""The lifecycles: the states of a component, of a pipeline, of a serving worker and of
an adapter, each with its one table.

Each table is the single source of truth of its machine: the machine is built from
it, the diagrams are drawn from that machine, and the docs embed the diagrams.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Generic, TypeAlias, TypeVar

import msgspec

__all__ = [
    "ADAPTER_TRANSITIONS",
    "INITIAL_ADAPTER_STATE",
    "INITIAL_PIPELINE_STATE",
    "INITIAL_STATE",
    "INITIAL_WORKER_STATE",
    "PIPELINE_TRANSITIONS",
    "TRANSITIONS",
    "TRIGGERS",
    "WORKER_TRANSITIONS",
    "AdapterState",
    "AnyState",
    "ComponentState",
    "Guard",
    "PipelineState",
    "TransitionRule",
    "WorkerState",
]


class ComponentState(StrEnum):
    """Where a component stands in its lifecycle."""

    CONFIGURED = "configured"
    ADMITTED = "admitted"
    LOADED = "loaded"
    RESIDENT = "resident"
    OFFLOADED = "offloaded"
    RELEASED = "released"


class PipelineState(StrEnum):
    """Where a pipeline stands in a worker (design §13).

    A pipeline is SERVING once loaded; SLEEPING, its components are off the device
    and stay admitted, loaded where their target allows; SWAPPING, a new pipeline of
    its name takes over (its requests wait for that one); DRAINING, it takes no new
    requests and its open ones finish; RELEASED, every component it held alone is
    released.
    """

    SERVING = "serving"
    SLEEPING = "sleeping"
    SWAPPING = "swapping"
    DRAINING = "draining"
    RELEASED = "released"


class WorkerState(StrEnum):
    """Where a serving worker stands (design §13); ``/readyz`` follows it.

    STARTING, it loads its pipelines; READY, it serves them; FAILED, one could not be
    loaded (the process stays up to say why); DRAINING, it takes no new requests,
    finishes the queued ones and releases every pipeline.
    """

    STARTING = "starting"
    READY = "ready"
    FAILED = "failed"
    DRAINING = "draining"


class AdapterState(StrEnum):
    """Where an adapter (a LoRA of one component, design §14) stands in its lifecycle.

    ADMITTED: its file's header fits the component; LOADED: its low-rank matrices are
    on the component's device; ACTIVE: merged into the component's weights (``merged``
    mode) or attached to its linear layers (``unmerged``); RELEASED: dropped.
    """

    CONFIGURED = "configured"
    ADMITTED = "admitted"
    LOADED = "loaded"
    ACTIVE = "active"
    RELEASED = "released"


class Guard(StrEnum):
    """A guard or postcondition a table names: the one spelling of each, for every machine.

    Whoever owns a model binds each guard its table names to the check that decides it
    (``Guarded``'s ``checks``): ``memory_budget`` guards a component's onload, a
    pipeline's wake and an adapter's load, each bound to its own check.
    """

    ATTENTION_PLAN = "attention_plan"
    LOADER_PATH = "loader_path"
    RESIDENCY_USE = "residency_use"
    BACKENDS_CONSUMABLE = "backends_consumable"
    WORLD_LAUNCHED = "world_launched"
    PLAN_HONOURED = "plan_honoured"
    PIPELINE_AWAKE = "pipeline_awake"
    MEMORY_BUDGET = "memory_budget"
    OFFLOADABLE = "offloadable"
    USE_DECLARED = "use_declared"
    NOT_IN_USE = "not_in_use"
    REQUESTS_ENDED = "requests_ended"
    TARGETS_FIT = "targets_fit"
    COMPONENT_KEPT = "component_kept"
    COMPONENT_WHOLE = "component_whole"
    COMPONENT_IDLE = "component_idle"


State = TypeVar("State", ComponentState, PipelineState, WorkerState, AdapterState)
"""The states of one machine: a row of its table names only those."""

AnyState: TypeAlias = ComponentState | PipelineState | WorkerState | AdapterState
"""A state of any machine (a refusal names the one it stayed in)."""


class TransitionRule(
    msgspec.Struct, Generic[State], frozen=True, kw_only=True, forbid_unknown_fields=True
):
    """One row of a transition table.

    Attributes:
        trigger: the method name that fires the transition.
        sources: the states it may fire from.
        dest: the state it leads to.
        guards: the admission predicates checked before any work; each is a
            function injected by the caller that returns refusals.
        postcondition: what the work itself must establish, checked after it
            ran; a breach fails the transition and rolls it back.
    """

    trigger: str
    sources: tuple[State, ...]
    dest: State
    guards: tuple[Guard, ...] = ()
    postcondition: Guard | None = None


_S = ComponentState
_G = Guard

TRANSITIONS: tuple[TransitionRule[ComponentState], ...] = (
    TransitionRule(
        trigger="admit",
        sources=(_S.CONFIGURED,),
        dest=_S.ADMITTED,
        guards=(_G.ATTENTION_PLAN, _G.LOADER_PATH, _G.RESIDENCY_USE, _G.BACKENDS_CONSUMABLE),
    ),
    TransitionRule(
        trigger="load",
        sources=(_S.ADMITTED,),
        dest=_S.LOADED,
        guards=(_G.WORLD_LAUNCHED,),
        postcondition=_G.PLAN_HONOURED,
    ),
    TransitionRule(
        trigger="onload",
        sources=(_S.LOADED, _S.OFFLOADED),
        dest=_S.RESIDENT,
        guards=(_G.PIPELINE_AWAKE, _G.MEMORY_BUDGET),
    ),
    TransitionRule(
        trigger="offload",
        sources=(_S.LOADED, _S.RESIDENT),
        dest=_S.OFFLOADED,
        guards=(_G.OFFLOADABLE, _G.USE_DECLARED, _G.NOT_IN_USE),
    ),
    TransitionRule(
        trigger="release",
        sources=tuple(state for state in ComponentState if state is not _S.RELEASED),
        dest=_S.RELEASED,
        guards=(_G.NOT_IN_USE,),
    ),
)

INITIAL_STATE = ComponentState.CONFIGURED
TRIGGERS: tuple[str, ...] = tuple(rule.trigger for rule in TRANSITIONS)
GUARDS: tuple[Guard, ...] = tuple(dict.fromkeys(g for rule in TRANSITIONS for g in rule.guards))

_P = PipelineState

PIPELINE_TRANSITIONS: tuple[TransitionRule[PipelineState], ...] = (
    TransitionRule(
        trigger="sleep",
        sources=(_P.SERVING,),
        dest=_P.SLEEPING,
        guards=(_G.REQUESTS_ENDED,),
    ),
    TransitionRule(
        trigger="wake",
        sources=(_P.SLEEPING,),
        dest=_P.SERVING,
        guards=(_G.MEMORY_BUDGET,),
    ),
    TransitionRule(trigger="swap", sources=(_P.SERVING, _P.SLEEPING), dest=_P.SWAPPING),
    TransitionRule(
        trigger="drain", sources=(_P.SERVING, _P.SLEEPING, _P.SWAPPING), dest=_P.DRAINING
    ),
    TransitionRule(
        trigger="release",
        sources=(_P.DRAINING,),
        dest=_P.RELEASED,
        guards=(_G.REQUESTS_ENDED,),
    ),
)
"""The pipeline's table: sleep (once its requests ended) offloads every component it
does not share with a pipeline that is awake; wake (when its resident components fit
beside what the other pipelines pin) puts them back where ``load`` placed them, and an
onload refused on the way fails it, rolled back; swap marks it as being replaced by a
new pipeline of its name (loaded beside it, or after it drains); drain marks it on its
way out; release follows once every component it held alone is released (a shared one
stays with its other users)."""

INITIAL_PIPELINE_STATE = PipelineState.SERVING

_W = WorkerState

WORKER_TRANSITIONS: tuple[TransitionRule[WorkerState], ...] = (
    TransitionRule(trigger="ready", sources=(_W.STARTING,), dest=_W.READY),
    TransitionRule(trigger="fail", sources=(_W.STARTING,), dest=_W.FAILED),
    TransitionRule(trigger="drain", sources=(_W.STARTING, _W.READY, _W.FAILED), dest=_W.DRAINING),
)
"""The serving worker's table: ready once every pipeline is loaded and warmed up, or
failed when one could not be; drain (a signal) from any of those, also while starting
(the load in progress finishes first, and none starts after). A worker's pipelines
each follow ``PIPELINE_TRANSITIONS`` meanwhile."""

INITIAL_WORKER_STATE = WorkerState.STARTING
_A = AdapterState

ADAPTER_TRANSITIONS: tuple[TransitionRule[AdapterState], ...] = (
    TransitionRule(
        trigger="admit",
        sources=(_A.CONFIGURED,),
        dest=_A.ADMITTED,
        guards=(_G.TARGETS_FIT, _G.COMPONENT_KEPT, _G.COMPONENT_WHOLE),
    ),
    TransitionRule(
        trigger="load",
        sources=(_A.ADMITTED,),
        dest=_A.LOADED,
        guards=(_G.MEMORY_BUDGET,),
    ),
    TransitionRule(
        trigger="activate",
        sources=(_A.LOADED,),
        dest=_A.ACTIVE,
        guards=(_G.COMPONENT_IDLE, _G.MEMORY_BUDGET),
    ),
    TransitionRule(
        trigger="deactivate",
        sources=(_A.ACTIVE,),
        dest=_A.LOADED,
        guards=(_G.COMPONENT_IDLE,),
    ),
    TransitionRule(
        trigger="release",
        sources=(_A.CONFIGURED, _A.ADMITTED, _A.LOADED),
        dest=_A.RELEASED,
    ),
)
"""The adapter's table: admit reads its file's header (every target a linear layer of
the component with the shapes it has, ranks that agree; a merge only into a component
that stays on the device, and never into one the layout shards); load reads its
matrices onto the device within the budget; activate merges it (keeping the base
weights, counted in the budget) or attaches it, and deactivate restores the base bit
for bit or detaches it: both only while no request uses the component (a request that
needs the change waits, as onloads wait); release drops it, never while active."""

INITIAL_ADAPTER_STATE = AdapterState.CONFIGURED
