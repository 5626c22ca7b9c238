"""Attention kernels, their capabilities, and how one is chosen for each layer (design §4)."""

from __future__ import annotations

import attention.log_routing  # noqa: F401  (routes events away from stdout; see the module)
from attention import registry
from attention.backend import AttentionBackend, AttentionImpl, DeviceKind, NoOptions
from attention.consumption import unconsumed
from attention.errors import (
    BackendSelectionError,
    NotResidentError,
    SelectionCode,
    UnknownBackendError,
)
from attention.layer import Attention, arm_layers, disarm_layers
from attention.platform import Platform
from attention.registry import register_backend
from attention.request import (
    DENSE_CROSS_FALLBACK,
    GLOBAL_BACKEND_FALLBACK,
    PLATFORM_DEFAULT_FALLBACK,
    BackendChoice,
    BackendRequest,
    ComponentRequests,
    PlannedSelection,
    RequestSource,
    Selection,
    SelectionRecord,
)
from attention.requirements import AttentionRequirements
from attention.roles import AttentionRole, Provenance
from attention.scope import AttentionScope, component_attention_scope, current_scope
from attention.selection import select_backend

__all__ = [
    "DENSE_CROSS_FALLBACK",
    "GLOBAL_BACKEND_FALLBACK",
    "PLATFORM_DEFAULT_FALLBACK",
    "Attention",
    "AttentionBackend",
    "AttentionImpl",
    "AttentionRequirements",
    "AttentionRole",
    "AttentionScope",
    "BackendChoice",
    "BackendRequest",
    "BackendSelectionError",
    "ComponentRequests",
    "DeviceKind",
    "NoOptions",
    "NotResidentError",
    "PlannedSelection",
    "Platform",
    "Provenance",
    "RequestSource",
    "Selection",
    "SelectionCode",
    "SelectionRecord",
    "UnknownBackendError",
    "arm_layers",
    "component_attention_scope",
    "current_scope",
    "disarm_layers",
    "register_backend",
    "registry",
    "select_backend",
    "unconsumed",
]
