"""Where a component's weights live off the device: host or disk, whole or block by block."""

from __future__ import annotations

from components.offload.base import OffloadError, StoreOptions, WeightStore
from components.offload.disk import DiskStore
from components.offload.factory import device_footprint, make_store, store_type
from components.offload.host import HostStore
from components.offload.layerwise import LayerwiseStore

__all__ = [
    "DiskStore",
    "HostStore",
    "LayerwiseStore",
    "OffloadError",
    "StoreOptions",
    "WeightStore",
    "device_footprint",
    "make_store",
    "store_type",
]
