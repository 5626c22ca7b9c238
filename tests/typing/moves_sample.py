"""Moves a type checker must refuse; ``test_moves.py`` runs mypy on this file, never imports it.

A line whose comment reads ``E:`` and a text must be reported by ``mypy --strict`` with
that text in its message, and no other line may be reported.
"""

from __future__ import annotations

from lifecycle.machines.component import ComponentLifecycle
from lifecycle.machines.engine import MoveArgs, TransitionContext


def typed(component: ComponentLifecycle, context: TransitionContext) -> int:
    """What the machine accepts: one MoveArgs per trigger, typed fields on the context."""
    component.onload(MoveArgs(position=2, request_id="r1"))
    component.offload(MoveArgs(eviction=True))
    assert component.offload.may(MoveArgs(eviction=True))
    victims: tuple[str, ...] = context.evictions
    return context.args.position + len(victims)


def misspelt(component: ComponentLifecycle, context: TransitionContext) -> None:
    """Misspelt, mistyped or untyped move arguments."""
    component.onload(MoveArgs(positon=2))  # E: Unexpected keyword argument "positon"
    component.offload(eviction=True)  # E: Unexpected keyword argument "eviction"
    component.onload(MoveArgs(position="2"))  # E: Argument "position" to "MoveArgs"
    component.trigger("onload", {"position": 2})  # E: Argument 2 to "trigger"
    evict = context.args.evict  # E: "MoveArgs" has no attribute "evict"
    decided = context.decisions  # E: "TransitionContext" has no attribute "decisions"
    context.evictions = ["a"]  # E: Incompatible types in assignment
    print(evict, decided)
