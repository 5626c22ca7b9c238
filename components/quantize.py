"""``quantization``: a component's linear weights as int8 or float8, through torchao (design §17).

Every ``nn.Linear`` of the module (of more than one input feature: ``quantized``) is
quantized by torchao's ``quantize_`` right after its weights are loaded, and nothing else:
biases, norms, embeddings and convolutions stay in the component's dtype.

- ``int8_weight_only``: int8 weights with one scale per output row; activations stay in
  the component's dtype (weights 4x smaller in float32, no speed on CPU);
- ``int8_dynamic``: int8 weights, and activations quantized to int8 per row at every
  call (int8 matrix products);
- ``float8_weight_only``: float8 (e4m3) weights with one scale per output row.

What a quantized weight holds is known from its shape alone (``weight_bytes``), so
admission counts the bytes from the headers' shapes, to the byte the loaded module
holds. A quantized weight is a tensor subclass whose data lie in plain inner tensors
(``components.accounting.inner_tensors``): the offload stores move, write and verify those.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Literal, TypeAlias

import torch
from torch import nn

from components.libraries import is_importable

__all__ = ["EXTRA", "Quantization", "missing_package", "quantize", "quantized", "quantized_bytes"]

Quantization: TypeAlias = Literal["off", "int8_weight_only", "int8_dynamic", "float8_weight_only"]
EXTRA = "accel"
"""The project's extra that installs torchao."""
PACKAGE = "torchao"

_SCALE = torch.float32
"""torchao keeps every scale in float32, whatever the weights' dtype (0.18, measured)."""
_ZERO_POINT = torch.int8
"""The int8 configs keep an int8 zero point per row too (zero for symmetric weights)."""


def missing_package() -> str | None:
    """Say that torchao is not installed and how to install it; None when it is."""
    if is_importable(PACKAGE):
        return None
    return f"the {PACKAGE} package is not installed (pip install 'pipeline-lifecycle[{EXTRA}]')"


def linear_weights(module: nn.Module) -> Iterator[tuple[str, torch.Size]]:
    """Yield the name and shape of each weight quantization replaces (``quantized``).

    Works on a module built on the meta device: admission sizes from these shapes.
    """
    for name, layer in module.named_modules():
        if quantized(layer):
            yield (f"{name}.weight" if name else "weight"), layer.weight.shape


def quantized(layer: nn.Module) -> bool:
    """Tell whether quantization replaces ``layer``'s weight: an ``nn.Linear`` of more than
    one input feature (torchao 0.18 cannot quantize a one-column weight: every config fails
    reshaping its scales, measured)."""
    return isinstance(layer, nn.Linear) and layer.in_features > 1


def weight_bytes(shape: torch.Size, quantization: Quantization) -> int:
    """Return the bytes one ``(out, in)`` linear weight holds once quantized.

    Data of one byte an element, a float32 scale per output row, and for the int8
    configs an int8 zero point per row.
    """
    rows = shape[0]
    per_row = _SCALE.itemsize + (_ZERO_POINT.itemsize if quantization.startswith("int8") else 0)
    return shape.numel() + rows * per_row


def quantized_bytes(
    module: nn.Module, dtype: torch.dtype, quantization: Quantization
) -> tuple[int, int]:
    """Return the bytes ``module``'s linear weights take in ``dtype`` and once quantized.

    ``module`` may be on the meta device; the caller swaps the first for the second.
    """
    shapes = [shape for _, shape in linear_weights(module)]
    plain = sum(shape.numel() * dtype.itemsize for shape in shapes)
    return plain, sum(weight_bytes(shape, quantization) for shape in shapes)


def quantize(module: nn.Module, quantization: Quantization) -> None:
    """Quantize every ``nn.Linear`` weight of ``module`` in place (nothing for ``off``).

    Raises:
        ModuleNotFoundError: torchao is not installed (admission refuses that first).
    """
    if quantization == "off":
        return
    config = torchao_config(quantization)
    from torchao.quantization import quantize_  # type: ignore[import-untyped]

    quantize_(module, config, filter_fn=lambda layer, _: quantized(layer))


def torchao_config(quantization: Quantization) -> object:
    """Return torchao's config for ``quantization`` (not ``off``): what ``quantize`` applies.

    Raises:
        ModuleNotFoundError: torchao is not installed.
    """
    return _configs()[quantization]()


def _configs() -> dict[str, type]:
    """Return torchao's config class for each quantization, importing torchao quietly.

    torchao logs a warning for each CUDA extension it cannot load on a CPU-only machine
    (two in 0.18), and torch one for an enum torchao registers the old way: harmless,
    and not the user's to act on.
    """
    loggers = [logging.getLogger(name) for name in (PACKAGE, "torch.utils._pytree")]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    try:
        from torchao.quantization import (
            Float8WeightOnlyConfig,
            Int8DynamicActivationInt8WeightConfig,
            Int8WeightOnlyConfig,
        )
    finally:
        for logger, level in zip(loggers, levels, strict=True):
            logger.setLevel(level)
    return {
        "int8_weight_only": Int8WeightOnlyConfig,
        "int8_dynamic": Int8DynamicActivationInt8WeightConfig,
        "float8_weight_only": Float8WeightOnlyConfig,
    }
