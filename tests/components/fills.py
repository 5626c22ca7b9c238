"""A torch function mode that records the random initialisers a block runs."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.overrides import TorchFunctionMode

from components.random_fills import RANDOM_FILLS


class Fills(TorchFunctionMode):
    """Record every random initialiser that reaches it, with the tensor it fills."""

    def __init__(self) -> None:
        super().__init__()
        self.filled: list[torch.Tensor] = []

    def __torch_function__(
        self,
        func: Callable[..., object],
        types: object,
        args: tuple[object, ...] = (),
        kwargs: dict[str, object] | None = None,
    ) -> object:
        kwargs = kwargs or {}
        if func in RANDOM_FILLS:
            tensor = args[0] if args else kwargs.get("tensor")
            assert isinstance(tensor, torch.Tensor)
            self.filled.append(tensor)
        return func(*args, **kwargs)
