"""How many bytes a module's weights take, counted once per storage."""

from __future__ import annotations

from torch import nn


def module_bytes(module: nn.Module) -> int:
    """Return the bytes of ``module``'s parameters and buffers; tied tensors count once."""
    seen: set[int] = set()
    total = 0
    for tensor in (*module.parameters(), *module.buffers()):
        if tensor.numel() == 0:
            continue
        storage = tensor.untyped_storage()
        if storage.data_ptr() in seen:
            continue
        seen.add(storage.data_ptr())
        total += storage.nbytes()
    return total
