"""A typed state-machine orchestrator for the components of a serving pipeline."""

from components.batch import Cancelled
from lifecycle.config import (
    AdapterSpec,
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
from lifecycle.plan import AdapterView, AdmissionPlan, ComponentPlan, PipelineSnapshot, SitePlan
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
from lifecycle.shared_device import SharedDevice
from lifecycle.states import (
    ADAPTER_TRANSITIONS,
    PIPELINE_TRANSITIONS,
    TRANSITIONS,
    WORKER_TRANSITIONS,
    AdapterState,
    ComponentState,
    PipelineState,
    TransitionRule,
    WorkerState,
)

__all__ = [
    "ADAPTER_TRANSITIONS",
    "PIPELINE_TRANSITIONS",
    "REFUSAL_CODES",
    "TRANSITIONS",
    "WORKER_TRANSITIONS",
    "AdapterSpec",
    "AdapterState",
    "AdapterView",
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
    "PipelineState",
    "Refusal",
    "RefusalCode",
    "Refused",
    "RequestRefused",
    "SharedDevice",
    "SitePlan",
    "StageSpec",
    "TransitionContext",
    "TransitionFailed",
    "TransitionRefused",
    "TransitionRule",
    "WorkerState",
    "configure_logging",
    "decode_spec",
    "load_spec",
]
