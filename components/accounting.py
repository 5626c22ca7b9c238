"""How many bytes a module's weights take, counted once per storage."""

from __future__ import annotations

import sys

import torch
from torch import nn
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

__all__ = ["inner_tensors", "local_shard", "module_bytes"]


def local_shard(tensor: torch.Tensor) -> torch.Tensor:
    """Return the shard this rank holds of a tensor- or FSDP-sharded weight, else ``tensor``."""
    # A DTensor exists only once torch.distributed.tensor is imported (the layouts that
    # shard import it), so a process without one never pays that ~0.6 CPU-s import to ask
    if "torch.distributed.tensor" not in sys.modules:
        return tensor
    from torch.distributed.tensor import DTensor

    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def inner_tensors(tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """Return the plain tensors that hold ``tensor``'s data, each with its attribute path.

    A plain tensor holds its own data (path ``""``); a quantized weight (a traceable
    wrapper subclass, ``components.quantize``) holds it in inner tensors (``qdata``,
    ``scale``, ...), which may be subclasses in turn. Swapping an inner tensor's ``.data``
    moves that part in place, as swapping a parameter's does. A sharded weight (a
    ``DTensor``) stays whole here: ``local_shard`` reads its part.
    """
    if not is_traceable_wrapper_subclass(tensor) or local_shard(tensor) is not tensor:
        return [("", tensor)]
    names, _ = tensor.__tensor_flatten__()
    found = []
    for name in names:
        for path, inner in inner_tensors(getattr(tensor, name)):
            found.append((f"{name}.{path}" if path else name, inner))
    return found


def module_bytes(module: nn.Module) -> int:
    """Return the bytes of ``module``'s parameters and buffers; tied tensors count once.

    A tensor sharded over ranks (a ``DTensor``: tensor parallel, FSDP) counts its local
    shard only: that is what this rank holds; a quantized weight, its inner tensors.
    """
    seen: set[int] = set()
    total = 0
    for held in (*module.parameters(), *module.buffers()):
        for _, tensor in inner_tensors(local_shard(held)):
            if tensor.numel() == 0:
                continue
            storage = tensor.untyped_storage()
            if storage.data_ptr() in seen:
                continue
            seen.add(storage.data_ptr())
            total += storage.nbytes()
    return total
