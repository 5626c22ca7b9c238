"""Dtypes: refuse one that a component's kind does not build, or its device cannot run."""

from __future__ import annotations

from collections.abc import Mapping
from functools import cache

import torch
from torch.nn import functional

from attention import Platform
from components.dtypes import TORCH_DTYPES, DType
from components.loader import ComponentLoader
from lifecycle.refusals import Refusal, RefusalCode
from lifecycle.spec.structs import PipelineSpec

__all__ = ["dtype_refusals"]


def dtype_refusals(
    spec: PipelineSpec, loaders: Mapping[str, ComponentLoader], platform: Platform
) -> list[Refusal]:
    """Refuse each component whose dtype its kind does not build or its device cannot run."""
    found = []
    for name, loader in loaders.items():
        dtype = spec.dtype_of(name)
        if dtype not in loader.dtypes:
            why = f"kind '{loader.kind}' builds its weights in {', '.join(loader.dtypes)} only"
        elif (problem := unsupported_dtype(platform.kind, dtype)) is not None:
            why = problem
        else:
            continue
        found.append(
            Refusal(
                code=RefusalCode.LOADER_UNAVAILABLE,
                component=name,
                message=f"component '{name}' is asked for in {dtype}, but {why}",
                hint=f"set components.{name}.dtype (or the pipeline's dtype) to one of "
                f"{', '.join(d for d in loader.dtypes if not unsupported_dtype(platform.kind, d))}",
            )
        )
    return found


@cache
def unsupported_dtype(device: str, dtype: DType) -> str | None:
    """Say why ``device`` (cpu, cuda) cannot run ``dtype``; None when it can.

    On CUDA, bfloat16 needs a device that supports it. Elsewhere the kernels a model
    needs most (a linear layer, a normalisation, a convolution) are tried once on tiny
    tensors: a build of torch without them says so by raising.
    """
    if device == "cuda":
        if dtype == "bfloat16" and torch.cuda.is_available() and not torch.cuda.is_bf16_supported():
            return "this CUDA device does not support bfloat16 (torch.cuda.is_bf16_supported())"
        return None
    kind = TORCH_DTYPES[dtype]
    x = torch.ones(1, 2, 2, 2, dtype=kind, device=device)
    try:
        functional.linear(x, torch.ones(2, 2, dtype=kind, device=device))
        functional.layer_norm(x, (2,))
        functional.conv2d(x, torch.ones(2, 2, 1, 1, dtype=kind, device=device))
    except RuntimeError as err:
        return f"the {device} kernels of this torch build cannot run {dtype} ({err})"
    return None
