"""How many bytes a module's weights take, counted once per storage."""

from __future__ import annotations

from torch import nn
from torch.distributed.tensor import DTensor


def module_bytes(module: nn.Module) -> int:
    """Return the bytes of ``module``'s parameters and buffers; tied tensors count once.

    A tensor sharded over ranks (a ``DTensor``: tensor parallel, FSDP) counts its local
    shard only: that is what this rank holds.
    """
    seen: set[int] = set()
    total = 0
    for held in (*module.parameters(), *module.buffers()):
        tensor = held.to_local() if isinstance(held, DTensor) else held
        if tensor.numel() == 0:
            continue
        storage = tensor.untyped_storage()
        if storage.data_ptr() in seen:
            continue
        seen.add(storage.data_ptr())
        total += storage.nbytes()
    return total
