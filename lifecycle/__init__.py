"""A typed state-machine orchestrator for the components of a serving pipeline."""

from lifecycle.config import (
    AttentionConfig,
    ComponentSpec,
    ConfigError,
    MemoryConfig,
    PipelineSpec,
    StageSpec,
    decode_spec,
    load_spec,
)
from lifecycle.logs import configure_logging
from lifecycle.machine import ComponentLifecycle, LifecycleMachine, TransitionContext
from lifecycle.refusals import (
    REFUSAL_CODES,
    AdmissionRefused,
    InvalidTransition,
    Refusal,
    TransitionFailed,
    TransitionRefused,
)
from lifecycle.states import TRANSITIONS, ComponentState, TransitionRule

__all__ = [
    "REFUSAL_CODES",
    "TRANSITIONS",
    "AdmissionRefused",
    "AttentionConfig",
    "ComponentLifecycle",
    "ComponentSpec",
    "ComponentState",
    "ConfigError",
    "InvalidTransition",
    "LifecycleMachine",
    "MemoryConfig",
    "PipelineSpec",
    "Refusal",
    "StageSpec",
    "TransitionContext",
    "TransitionFailed",
    "TransitionRefused",
    "TransitionRule",
    "configure_logging",
    "decode_spec",
    "load_spec",
]
