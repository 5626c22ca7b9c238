"""Skip torch's random initialisers where the values they would draw are never read.

A module's constructor fills its parameters at random (``reset_parameters``, a library's
``_init_weights``). That is wasted work in two places: on the ``meta`` device, where a
tensor has no values (and torch, lacking native meta kernels for ``uniform_`` and
``normal_``, runs their Python reference implementations, 50-700 us a call); and when
the loader overwrites every parameter right after construction, from a weights file or
a seed (an ``nn.Embedding`` of BERT's vocabulary draws 11.7 M normals for nothing).
A torch function mode is the constructing thread's alone and replaces no attribute, so
no other thread's build and no library imported meanwhile sees it; torch's own
``trunc_normal_`` skips meta tensors the same way.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

__all__ = ["RANDOM_FILLS", "RandomFillsSkipped", "built_on_meta", "fill_target", "is_parameter"]

_INIT_NAMES = frozenset(n for n in dir(nn.init) if n.endswith("_") and not n.startswith("_"))
"""The names of ``torch.nn.init``'s initialisers."""
RANDOM_FILLS = frozenset(
    {*(getattr(nn.init, n) for n in _INIT_NAMES), torch.Tensor.uniform_, torch.Tensor.normal_}
)
"""What fills a tensor with values and nothing else: ``torch.nn.init``'s initialisers and
the samplers they call."""
_LIBRARY_INITS = "transformers.initialization"
"""transformers' initialisers: while a model's ``_init_weights`` runs, transformers puts
them in ``torch.nn.init`` under the same names, so ``nn.init`` dispatches as them (BERT's
11.7 M-normal embedding among them). Known by module and name: transformers is optional,
and never imported for this."""


class RandomFillsSkipped(TorchFunctionMode):
    """Return the tensor untouched from an initialiser when ``skips(tensor)``; run
    everything else as is."""

    def __init__(self, skips: Callable[[torch.Tensor], bool]) -> None:
        super().__init__()
        self._skips = skips

    def __torch_function__(
        self,
        func: Callable[..., object],
        types: object,
        args: tuple[object, ...] = (),
        kwargs: dict[str, object] | None = None,
    ) -> object:
        kwargs = kwargs or {}
        tensor = fill_target(func, args, kwargs)
        if tensor is not None and self._skips(tensor):
            return tensor
        return func(*args, **kwargs)


def fill_target(
    func: Callable[..., object], args: tuple[object, ...], kwargs: dict[str, object]
) -> torch.Tensor | None:
    """Return the tensor a call of ``func`` fills at random; None when ``func`` is no
    random initialiser."""
    if func not in RANDOM_FILLS and not _library_init(func):
        return None
    # nn.init passes its tensor by keyword when it dispatches to a torch function mode
    tensor = args[0] if args else kwargs.get("tensor")
    return tensor if isinstance(tensor, torch.Tensor) else None


def _library_init(func: Callable[..., object]) -> bool:
    """Tell whether ``func`` is one of transformers' stand-ins for ``nn.init``'s."""
    module = getattr(func, "__module__", None)
    return module == _LIBRARY_INITS and getattr(func, "__name__", None) in _INIT_NAMES


def is_parameter(tensor: torch.Tensor) -> bool:
    """Tell whether ``tensor`` is a module's parameter (what a loader overwrites)."""
    return isinstance(tensor, nn.Parameter)


def built_on_meta(build: Callable[[], nn.Module]) -> nn.Module:
    """Run ``build`` on the ``meta`` device, its random fills skipped: what admission looks
    at (a block stack, the layers an adapter targets, quantized sizes) costs no memory and
    no initialisation."""
    with torch.device("meta"), RandomFillsSkipped(lambda tensor: tensor.is_meta):
        return build()
