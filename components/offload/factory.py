"""The one place that maps a residency mode and an offload target to a weight store."""

from __future__ import annotations

from torch import nn

from components.offload.base import OffloadError, StoreOptions, WeightStore
from components.offload.disk import DiskStore
from components.offload.host import HostStore
from components.offload.layerwise import LayerwiseStore
from components.residency import OffloadTarget, ResidencyMode

__all__ = ["device_footprint", "make_store", "store_type"]


def store_type(
    mode: ResidencyMode, target: OffloadTarget, options: StoreOptions
) -> type[WeightStore]:
    """Return the store type that keeps a component of ``mode`` offloaded to ``target``.

    A resident component gets a host store (its weights never leave the device
    but through an eviction, which needs no file).

    Raises:
        OffloadError: a layerwise component came without a block stack: it is never
            moved whole instead.
    """
    if mode is ResidencyMode.LAYERWISE_OFFLOAD:
        if options.blocks is None:
            raise OffloadError(
                "layerwise offload streams a block stack, and none was given; pass "
                "StoreOptions.blocks, or use component_offload to move the module whole"
            )
        return LayerwiseStore
    if mode is ResidencyMode.RESIDENT or target == "host":
        return HostStore
    return DiskStore


def make_store(
    module: nn.Module,
    mode: ResidencyMode,
    target: OffloadTarget,
    options: StoreOptions,
    *,
    resident: bool = False,
) -> WeightStore:
    """Build the store for ``module``, resident or offloaded (its first offload).

    Raises:
        OffloadError: the module cannot be kept in that store (the message says why).
    """
    return store_type(mode, target, options).from_options(
        module, target, options, resident=resident
    )


def device_footprint(
    module: nn.Module, mode: ResidencyMode, target: OffloadTarget, options: StoreOptions
) -> int:
    """Return the most device bytes the store :func:`make_store` would build holds."""
    return store_type(mode, target, options).footprint_of(module, options)
