"""How many bytes a module's weights take, counted once per storage."""

from __future__ import annotations

import sys

import torch
from torch import nn


def local_shard(tensor: torch.Tensor) -> torch.Tensor:
    """Return the shard this rank holds of a tensor- or FSDP-sharded weight, else ``tensor``."""
    # A DTensor exists only once torch.distributed.tensor is imported (the layouts that
    # shard import it), so a process without one never pays that ~0.6 CPU-s import to ask
    if "torch.distributed.tensor" not in sys.modules:
        return tensor
    from torch.distributed.tensor import DTensor

    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def module_bytes(module: nn.Module) -> int:
    """Return the bytes of ``module``'s parameters and buffers; tied tensors count once.

    A tensor sharded over ranks (a ``DTensor``: tensor parallel, FSDP) counts its local
    shard only: that is what this rank holds.
    """
    seen: set[int] = set()
    total = 0
    for held in (*module.parameters(), *module.buffers()):
        tensor = local_shard(held)
        if tensor.numel() == 0:
            continue
        storage = tensor.untyped_storage()
        if storage.data_ptr() in seen:
            continue
        seen.add(storage.data_ptr())
        total += storage.nbytes()
    return total
