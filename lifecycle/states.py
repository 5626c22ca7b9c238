"""The component lifecycle: its states and the one transition table.

This table is the single source of truth: the machine is built from it, the
diagrams are drawn from that machine, and the docs embed the diagrams.
"""

from __future__ import annotations

from enum import StrEnum

import msgspec


class ComponentState(StrEnum):
    """Where a component stands in its lifecycle."""

    CONFIGURED = "configured"
    ADMITTED = "admitted"
    LOADED = "loaded"
    RESIDENT = "resident"
    OFFLOADED = "offloaded"
    RELEASED = "released"


class TransitionRule(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """One row of the transition table.

    Attributes:
        trigger: the method name that fires the transition.
        sources: the states it may fire from.
        dest: the state it leads to.
        guards: names of the admission predicates checked before any work;
            each is a function injected by the caller that returns refusals.
        postcondition: what the work itself must establish, checked after it
            ran; a breach fails the transition and rolls it back.
    """

    trigger: str
    sources: tuple[ComponentState, ...]
    dest: ComponentState
    guards: tuple[str, ...] = ()
    postcondition: str | None = None


_S = ComponentState

TRANSITIONS: tuple[TransitionRule, ...] = (
    TransitionRule(
        trigger="admit",
        sources=(_S.CONFIGURED,),
        dest=_S.ADMITTED,
        guards=("attention_plan", "loader_path", "residency_use", "backends_consumable"),
    ),
    TransitionRule(
        trigger="load",
        sources=(_S.ADMITTED,),
        dest=_S.LOADED,
        guards=("world_launched",),
        postcondition="plan_honoured",
    ),
    TransitionRule(
        trigger="onload",
        sources=(_S.LOADED, _S.OFFLOADED),
        dest=_S.RESIDENT,
        guards=("memory_budget",),
    ),
    TransitionRule(
        trigger="offload",
        sources=(_S.LOADED, _S.RESIDENT),
        dest=_S.OFFLOADED,
        guards=("offloadable", "use_declared", "not_in_use"),
    ),
    TransitionRule(
        trigger="release",
        sources=tuple(state for state in ComponentState if state is not _S.RELEASED),
        dest=_S.RELEASED,
        guards=("not_in_use",),
    ),
)

INITIAL_STATE = ComponentState.CONFIGURED
TRIGGERS: tuple[str, ...] = tuple(rule.trigger for rule in TRANSITIONS)
GUARDS: tuple[str, ...] = tuple(dict.fromkeys(g for rule in TRANSITIONS for g in rule.guards))
