"""A typed state-machine orchestrator for the components of a serving pipeline."""

from components.batch import Cancelled
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
from lifecycle.machine import ComponentLifecycle, LifecycleMachine, MoveArgs, TransitionContext
from lifecycle.orchestrator import ComponentView, Orchestrator
from lifecycle.plan import AdmissionPlan, ComponentPlan, PipelineSnapshot, SitePlan
from lifecycle.refusals import (
    REFUSAL_CODES,
    AdmissionRefused,
    InvalidTransition,
    Refusal,
    RefusalCode,
    Refused,
    RequestRefused,
    TransitionFailed,
    TransitionRefused,
)
from lifecycle.states import TRANSITIONS, ComponentState, TransitionRule

__all__ = [
    "REFUSAL_CODES",
    "TRANSITIONS",
    "AdmissionPlan",
    "AdmissionRefused",
    "AttentionConfig",
    "Cancelled",
    "ComponentLifecycle",
    "ComponentPlan",
    "ComponentSpec",
    "ComponentState",
    "ComponentView",
    "ConfigError",
    "InvalidTransition",
    "LifecycleMachine",
    "MemoryConfig",
    "MoveArgs",
    "Orchestrator",
    "PipelineSnapshot",
    "PipelineSpec",
    "Refusal",
    "RefusalCode",
    "Refused",
    "RequestRefused",
    "SitePlan",
    "StageSpec",
    "TransitionContext",
    "TransitionFailed",
    "TransitionRefused",
    "TransitionRule",
    "configure_logging",
    "decode_spec",
    "load_spec",
]
