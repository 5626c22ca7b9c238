"""LoRA on any ``nn.Linear``: merged into its weight (the base kept), or added in its forward.

Merged: a layer's weight becomes ``W + sum_i s_i * alpha_i / r_i * B_i A_i`` over the
adapters merged into it, in name order, always computed from the base ``W``; the base
tensor itself is kept, so restoring it is exact (no subtraction in floating point) and
the weights depend only on the set merged, not on the order of switches.

Unmerged: a forward hook adds ``s * alpha / r * B A x`` to the layer's output, with ``s``
taken per row from ``components.adapters.rows`` (zero rows add nothing; the base weight
is never touched, so an offload copy of it stays valid).

The arithmetic follows PEFT's LoRA layer: the delta ``(B @ A) * scaling`` added to the
weight when merging (in float32 for half-precision weights on the CPU), and
``B(A(x)) * scaling`` added to the output when not.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn
from torch.nn.functional import linear
from torch.utils.hooks import RemovableHandle

from components.adapters.files import LoraTarget
from components.adapters.rows import ROWS

__all__ = ["LoraMatrices", "attach", "linear_layers", "merged_weight", "read_matrices"]

# R rows, r rank, I in features, O out features


@dataclass(frozen=True)
class LoraMatrices:
    """One layer's LoRA, on the device and in the dtype of the layer's weight.

    Attributes:
        down: ``A``, ``(r, I)``.
        up: ``B``, ``(O, r)``.
        scaling: ``alpha / r`` (a request's or merge's scale multiplies it).
    """

    down: torch.Tensor
    up: torch.Tensor
    scaling: float

    @property
    def nbytes(self) -> int:
        """The bytes both matrices hold."""
        return sum(t.numel() * t.element_size() for t in (self.down, self.up))


def linear_layers(module: nn.Module, names: Iterable[str]) -> dict[str, nn.Linear]:
    """Return the linear layers of ``module`` at ``names`` (module paths).

    Raises:
        LookupError: one is missing or not linear (admission refuses that first).
    """
    found = dict(module.named_modules())
    layers = {}
    for name in names:
        layer = found.get(name)
        if not isinstance(layer, nn.Linear):
            raise LookupError(f"{type(module).__name__} has no linear layer '{name}'")
        layers[name] = layer
    return layers


def read_matrices(
    path: Path,
    targets: Mapping[str, LoraTarget],
    layers: Mapping[str, nn.Linear],
    alpha_ratio: float,
    device: torch.device,
) -> dict[str, LoraMatrices]:
    """Read each target's matrices from ``path`` onto ``device`` in its layer's dtype.

    Raises:
        OSError: the file cannot be read.
        ValueError: the file changed since admission (a key or shape differs).
    """
    matrices = {}
    with safe_open(path, framework="pt") as file:
        for name, target in targets.items():
            dtype = layers[name].weight.dtype
            down = file.get_tensor(target.down_key).to(device, dtype)
            up = file.get_tensor(target.up_key).to(device, dtype)
            if down.shape != (target.rank, target.in_features) or up.shape != (
                target.out_features,
                target.rank,
            ):
                raise ValueError(
                    f"adapter file {path} changed since it was admitted: '{target.down_key}' "
                    f"and '{target.up_key}' have shapes {list(down.shape)}, {list(up.shape)}"
                )
            matrices[name] = LoraMatrices(down, up, alpha_ratio)
    return matrices


def merged_weight(base: torch.Tensor, merged: list[tuple[LoraMatrices, float]]) -> torch.Tensor:
    """Return ``base`` plus each LoRA's delta at its scale, in order; ``base`` is not changed."""
    weight = base
    for matrices, scale in merged:
        half_on_cpu = base.device.type == "cpu" and base.dtype in (torch.float16, torch.bfloat16)
        up, down = matrices.up, matrices.down
        if half_on_cpu:  # as PEFT: a half-precision matmul on the CPU is slow and lossy
            up, down = up.float(), down.float()
        delta = (up @ down) * (matrices.scaling * scale)  # (O, I)
        weight = weight + delta.to(base.dtype)
    return weight


def attach(layer: nn.Linear, adapter: str, matrices: LoraMatrices) -> RemovableHandle:
    """Add ``adapter``'s per-row delta to ``layer``'s output; return the handle that detaches it.

    Rows that do not name the adapter (and forwards outside ``batch_rows``) add nothing.
    """
    down, up, scaling = matrices.down, matrices.up, matrices.scaling

    def add_delta(
        module: nn.Module, args: tuple[torch.Tensor, ...], output: torch.Tensor
    ) -> torch.Tensor | None:
        rows = ROWS.get()
        if rows is None:
            return None
        x = args[0]  # (R, ..., I)
        scale = rows.scale(adapter, x.shape[0])
        if scale is None:
            return None
        lora = linear(linear(x.to(down.dtype), down), up)  # (R, ..., O)
        if isinstance(scale, torch.Tensor):
            per_row = scale.to(lora.device, lora.dtype) * scaling  # (R,)
            lora = lora * per_row.view(-1, *(1,) * (lora.dim() - 1))
        else:
            lora = lora * (scale * scaling)
        return output + lora.to(output.dtype)

    return layer.register_forward_hook(add_delta)
