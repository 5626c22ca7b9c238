"""A torch function mode that records the random initialisers a block runs."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.overrides import TorchFunctionMode

from components.random_fills import fill_target


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
        tensor = fill_target(func, args, kwargs)
        if tensor is not None:
            self.filled.append(tensor)
        return func(*args, **kwargs)
