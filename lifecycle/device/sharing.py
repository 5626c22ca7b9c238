"""When two pipelines hold one component: its identity (design §13).

Two components are the same when they would build the same module and keep it the
same way: the same kind, the same options (but the weights file's path), the same
weights, the same admitted build (loader path and each attention site's backend),
the same residency (mode, layerwise settings, offload target and verification) and
the same parallel layout on the same device.

"The same weights" means the same content, never the same path: for a weights file,
each tensor's name, dtype, shape and xxh3 checksum; for a kind that makes its weights
from a seed, the seed itself (an option), since the kind's weights are a function of
its options (``components.weights.seed_weights``), float32 like every seeded kind's.
"""

from __future__ import annotations

from pathlib import Path

import msgspec

from components.weights import TensorChecksum, tensor_checksums
from lifecycle.device.slots import ComponentSlot
from lifecycle.spec.structs import PipelineSpec

__all__ = ["ComponentIdentity", "component_identity"]


class ComponentIdentity(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Everything that makes two components one: equal identities may share a module.

    Attributes:
        kind: the kind that builds it.
        options: its validated options but the weights path, as canonical JSON.
        weights: each tensor of its weights file with its checksum; empty for weights
            made from a seed (``options`` holds the seed).
        build: its admitted plan (loader path, attention sites and their backends) as JSON.
        keeping: how it is kept and run: residency mode, layerwise settings, offload
            target and verification, parallel layout, device and step cache, as JSON.
    """

    kind: str
    options: bytes
    weights: tuple[TensorChecksum, ...]
    build: bytes
    keeping: bytes


def component_identity(slot: ComponentSlot, spec: PipelineSpec, device: str) -> ComponentIdentity:
    """Return the identity of ``slot``, an admitted component of ``spec`` on ``device``.

    Reads the weights file once, if it has one, to checksum each tensor.

    Raises:
        RuntimeError: the component was not admitted.
        OSError, ValueError: its weights file cannot be read (its load would fail too).
    """
    if slot.plan is None:
        raise RuntimeError(f"component '{slot.name}' was never admitted; admit() it first")
    options = slot.loader.options
    weights = options.weights
    memory = spec.memory
    return ComponentIdentity(
        kind=slot.spec.kind,
        options=msgspec.json.encode(msgspec.structs.replace(options, weights=None)),
        weights=() if weights is None else tensor_checksums(Path(weights)),
        build=msgspec.json.encode(slot.plan),
        keeping=msgspec.json.encode(
            {
                "layerwise": slot.spec.layerwise_config,
                "target": memory.offload_target,
                "verify": memory.verify_offload,
                "parallel": spec.parallel,
                "device": device,
                # a step cache is how its kind runs it: pipelines that run it apart hold it apart
                "cache": slot.spec.cache_settings,
            }
        ),
    )
