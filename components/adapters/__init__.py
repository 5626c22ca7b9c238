"""Adapters (LoRA) of a component: their files, where they fit, how they apply (design §14)."""

from components.adapters.files import AdapterFile, KeyProblem, LoraTarget
from components.adapters.lora import (
    LoraMatrices,
    attach,
    linear_layers,
    merged_weight,
    read_matrices,
)
from components.adapters.rows import AdapterRows, batch_rows
from components.adapters.targets import target_problems

__all__ = [
    "AdapterFile",
    "AdapterRows",
    "KeyProblem",
    "LoraMatrices",
    "LoraTarget",
    "attach",
    "batch_rows",
    "linear_layers",
    "merged_weight",
    "read_matrices",
    "target_problems",
]
