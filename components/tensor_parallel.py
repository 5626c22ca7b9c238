"""Split a module's layers with DTensor; a split linear computes on its own shards.

DTensor derives the sharding of every operation on a ``DTensor`` from the operation's
inputs, tracing its decomposition under fake tensors for each new input shape: a server
meets a new shape at every new image size or prompt length, on every rank, and a
denoiser calls its layers every step. Measured on CPU (torch 2.13), two split linears:
200 to 300 ms of CPU for each new input shape under inference mode (where ``linear``
reaches DTensor whole), 30 to 45 ms under ``no_grad``, and 2 to 30 ms for every later
call. A split ``nn.Linear`` needs none of it: its shards already say what it computes
(``_forward_on_shards``). Any other split layer runs DTensor's computation outside
inference mode, the cheaper of the two.
"""

from __future__ import annotations

import types
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.nn import functional

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import ParallelStyle

__all__ = ["split_layers"]


def split_layers(module: nn.Module, mesh: DeviceMesh, plan: Mapping[str, ParallelStyle]) -> None:
    """Split the layers of ``module`` named in ``plan`` over ``mesh`` (``parallelize_module``),
    each rank keeping its shards of its own copy: the ranks must hold the same weights.

    A split ``nn.Linear`` multiplies its local shards and hands DTensor the placement of
    the result (column-wise: this rank's output features; row-wise: a partial sum, which
    the layer's output hook all-reduces as before). Any other split layer's computation
    runs outside inference mode, without autograd; what it returns is used as before
    (inference tensors mix freely with it).
    """
    # imported here: torch.distributed.tensor costs ~0.6 CPU-s, which only a process
    # whose layout splits tensors should pay
    from torch.distributed.tensor.parallel import parallelize_module

    # every rank built the whole module from the same files: each cuts its own shards
    # (src_data_rank None), where the default scatters every weight from the first rank
    parallelize_module(module, mesh, dict(plan), src_data_rank=None)
    for path in plan:
        layer = module.get_submodule(path)
        linear = type(layer).forward is nn.Linear.forward  # not a subclass's own forward
        forward = _forward_on_shards if linear else _forward_outside_inference_mode
        # bound to the layer, so that a copy of the module binds to its own copy
        layer.forward = types.MethodType(forward, layer)


def _forward_on_shards(layer: nn.Linear, x: DTensor) -> DTensor:
    """Compute a split linear on this rank's shards; the input is the DTensor its input hook
    made (replicated column-wise, the last dimension's shard row-wise)."""
    from torch.distributed.tensor import DTensor, Partial, Shard

    weight, bias = layer.weight, layer.bias
    assert isinstance(weight, DTensor)
    assert bias is None or isinstance(bias, DTensor)
    mesh = weight.device_mesh
    local_bias = None if bias is None else bias.to_local()
    if weight.placements == (Shard(0),):  # column-wise: this rank's output features
        out = functional.linear(x.to_local(), weight.to_local(), local_bias)
        # the global shape: the features need not divide by the degree (uneven shards)
        shape = torch.Size((*out.shape[:-1], weight.shape[0]))
        return DTensor.from_local(
            out, mesh, [Shard(-1)], run_check=False, shape=shape, stride=_contiguous(shape)
        )
    # row-wise: every output feature's partial sum over this rank's input features; the
    # replicated bias joins the sum once, on the group's first rank
    out = functional.linear(x.to_local(), weight.to_local())
    if local_bias is not None and mesh.get_local_rank() == 0:
        out = out + local_bias
    return DTensor.from_local(out, mesh, [Partial()], run_check=False)


def _forward_outside_inference_mode(layer: nn.Module, *args: Any, **kwargs: Any) -> Any:
    forward = type(layer).forward
    if not torch.is_inference_mode_enabled():
        return forward(layer, *args, **kwargs)
    with torch.inference_mode(False), torch.no_grad():
        return forward(layer, *args, **kwargs)


def _contiguous(shape: torch.Size) -> tuple[int, ...]:
    """Return the strides of a contiguous tensor of ``shape`` (no tensor made: a split
    linear asks at every call)."""
    strides = [1]
    for size in reversed(shape[1:]):
        strides.insert(0, strides[0] * max(size, 1))  # as torch strides an empty dimension
    return tuple(strides)
