"""A typed state-machine orchestrator for the components of a serving pipeline.

The names below are imported on first use (PEP 562): ``import lifecycle`` imports
neither torch nor the rest of the house, so that the ``lifecycle`` command runs its own
code first (it catches SIGINT and sets OpenMP's wait policy before torch is loaded).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from components.batch import Cancelled
    from lifecycle.device.shared import SharedDevice
    from lifecycle.logs import configure_logging
    from lifecycle.machines.component import ComponentLifecycle, LifecycleMachine
    from lifecycle.machines.engine import MoveArgs, TransitionContext
    from lifecycle.machines.tables import (
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
    from lifecycle.spec.errors import ConfigError
    from lifecycle.spec.reading import decode_spec, load_spec
    from lifecycle.spec.structs import (
        AdapterSpec,
        AttentionConfig,
        ComponentSpec,
        MemoryConfig,
        PipelineSpec,
        StageSpec,
    )

_HOMES = {
    "Cancelled": "components.batch",
    "AdapterSpec": "lifecycle.spec.structs",
    "AttentionConfig": "lifecycle.spec.structs",
    "ComponentSpec": "lifecycle.spec.structs",
    "ConfigError": "lifecycle.spec.errors",
    "MemoryConfig": "lifecycle.spec.structs",
    "PipelineSpec": "lifecycle.spec.structs",
    "StageSpec": "lifecycle.spec.structs",
    "decode_spec": "lifecycle.spec.reading",
    "load_spec": "lifecycle.spec.reading",
    "configure_logging": "lifecycle.logs",
    "ComponentLifecycle": "lifecycle.machines.component",
    "LifecycleMachine": "lifecycle.machines.component",
    "MoveArgs": "lifecycle.machines.engine",
    "TransitionContext": "lifecycle.machines.engine",
    "ComponentView": "lifecycle.orchestrator",
    "Orchestrator": "lifecycle.orchestrator",
    "AdapterView": "lifecycle.plan",
    "AdmissionPlan": "lifecycle.plan",
    "ComponentPlan": "lifecycle.plan",
    "PipelineSnapshot": "lifecycle.plan",
    "SitePlan": "lifecycle.plan",
    "AdmissionRefused": "lifecycle.refusals",
    "InvalidTransition": "lifecycle.refusals",
    "REFUSAL_CODES": "lifecycle.refusals",
    "Refusal": "lifecycle.refusals",
    "RefusalCode": "lifecycle.refusals",
    "Refused": "lifecycle.refusals",
    "RequestRefused": "lifecycle.refusals",
    "TransitionFailed": "lifecycle.refusals",
    "TransitionRefused": "lifecycle.refusals",
    "SharedDevice": "lifecycle.device.shared",
    "ADAPTER_TRANSITIONS": "lifecycle.machines.tables",
    "AdapterState": "lifecycle.machines.tables",
    "ComponentState": "lifecycle.machines.tables",
    "PIPELINE_TRANSITIONS": "lifecycle.machines.tables",
    "PipelineState": "lifecycle.machines.tables",
    "TRANSITIONS": "lifecycle.machines.tables",
    "TransitionRule": "lifecycle.machines.tables",
    "WORKER_TRANSITIONS": "lifecycle.machines.tables",
    "WorkerState": "lifecycle.machines.tables",
}
"""The module each exported name is imported from (the imports above, for the checkers)."""

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


if not TYPE_CHECKING:  # the checkers see the imports above; a typo stays an error for them

    def __getattr__(name: str) -> Any:
        """Import ``name`` from its module on first use, and keep it here."""
        if name not in _HOMES:
            raise AttributeError(f"module 'lifecycle' has no attribute {name!r}")
        value = getattr(importlib.import_module(_HOMES[name]), name)
        globals()[name] = value
        return value


def __dir__() -> list[str]:
    """List the exported names too, imported yet or not."""
    return sorted({*globals(), *__all__})
