"""Build a model with no weights, say what it expects, and give it the mapped file's tensors.

A library class (``T5EncoderModel``, ``FluxTransformer2DModel``) is built with every
parameter on the ``meta`` device: no memory, no initialisation cost, and the names,
shapes and dtypes it expects are known. Buffers stay real, since many are computed in
``__init__`` and never stored (CLIP's position ids, PixArt's sine-cosine position
table). Loading then hands each parameter the tensor safetensors maps from the file:
the weights exist once, in the mapped pages, whatever the size of the model.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import NamedTuple, Protocol

import torch
from safetensors import safe_open
from torch import nn
from torch._C import _disabled_torch_function_impl
from torch.nn.modules.module import register_module_parameter_registration_hook

from components.random_fills import fill_target
from components.weights import DeclaredTensor, DeclaredTensors, StoredTensor, stored_problems

__all__ = ["Expected", "assign_weights", "build_empty", "expected_tensors"]

# One build at a time: the registration hook is process-wide while it is installed.
_building = threading.Lock()


class _Unfilled(nn.Parameter):
    """A parameter an empty build moved to ``meta``: a random initialiser called on it
    (``components.random_fills.fill_target``) returns it untouched, since it has no values
    to fill; every other torch call runs as on a plain parameter.

    Only calls that take such a parameter come here, where a torch function mode would see
    every call of the constructor (about 1 us each, thousands in a DiT), and on ``meta``
    torch has no native samplers: it runs their Python reference implementations, 20-300
    us a call.
    """

    @classmethod
    def __torch_function__(
        cls,
        func: Callable[..., object],
        types: Iterable[type],
        args: tuple[object, ...] = (),
        kwargs: dict[str, object] | None = None,
    ) -> object:
        kwargs = kwargs or {}
        tensor = fill_target(func, args, kwargs)
        if tensor is not None and tensor.is_meta:
            return tensor
        return _disabled_torch_function_impl(func, types, args, kwargs)  # nn.Parameter's own

    def __deepcopy__(self, memo: dict[int, object]) -> nn.Parameter:
        """Copy into a plain parameter: a constructor that clones a layer (``deepcopy``)
        would otherwise keep a copy the build never turns back."""
        if id(self) not in memo:
            memo[id(self)] = nn.Parameter(self.data.clone(), self.requires_grad)
        copied: nn.Parameter = memo[id(self)]  # type: ignore[assignment]
        return copied


@contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Make every parameter this thread registers inside the block a ``meta`` tensor;
    buffers stay real.

    torch's module-wide parameter registration hook replaces each parameter as a
    module registers it, so initialisers that follow (``reset_parameters``, a library's
    ``_init_weights``) run on meta parameters, where the random ones are no-ops. The hook
    is process-wide: it leaves the parameters of every other thread's modules as they
    are. When the block ends every moved parameter is a plain ``nn.Parameter`` again.
    """
    builder = threading.get_ident()
    moved: list[nn.Parameter] = []

    def to_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> nn.Parameter | None:
        if param is None or param.device.type == "meta" or threading.get_ident() != builder:
            return None
        moved.append(_Unfilled(param.to("meta"), requires_grad=False))
        return moved[-1]

    with _building:
        # torch types the hook as returning None, but uses what it returns (torch 2.x)
        handle = register_module_parameter_registration_hook(to_meta)  # type: ignore[arg-type]
        try:
            yield
        finally:
            handle.remove()
            for parameter in moved:
                parameter.__class__ = nn.Parameter


def build_empty(factory: Callable[[], nn.Module]) -> nn.Module:
    """Build ``factory()`` with its parameters on ``meta`` (see ``parameters_on_meta``)."""
    with parameters_on_meta(), torch.no_grad():
        return factory()


class Expected(NamedTuple):
    """What a model built by ``build_empty`` expects its weights files to hold.

    Attributes:
        tensors: each stored tensor by its canonical name (the first of its tie group).
        aliases: every other name of a tied tensor -> its canonical name; a file may
            store a tied tensor under any one of its names.
        unstored: the buffers the class computes and never stores (position tables,
            ids), which the module holds besides its weights.
    """

    tensors: DeclaredTensors
    aliases: dict[str, str]
    unstored: dict[str, torch.Tensor]

    def problems(self, stored: Mapping[str, StoredTensor]) -> list[str]:
        """Say how ``stored`` (a header, shards merged) fails these tensors; [] when it fits."""
        canonical = {self.aliases.get(name, name): tensor for name, tensor in stored.items()}
        return stored_problems(canonical, self.tensors)


def expected_tensors(module: nn.Module) -> Expected:
    """Return the tensors ``module``'s state dict holds, tied names folded into one."""
    tensors: DeclaredTensors = {}
    aliases: dict[str, str] = {}
    first: dict[int, str] = {}
    state = module.state_dict(keep_vars=True)
    for name, tensor in state.items():
        owner = first.setdefault(id(tensor), name)
        if owner != name:
            aliases[name] = owner
            continue
        tensors[name] = DeclaredTensor(tuple(tensor.shape), tensor.is_floating_point())
    stored = {id(tensor) for tensor in state.values()}
    unstored = {name: b.to("meta") for name, b in module.named_buffers() if id(b) not in stored}
    return Expected(tensors, aliases, unstored)


def assign_weights(
    module: nn.Module,
    stored: Mapping[str, tuple[Path, str]],
    dtype: torch.dtype,
    keep_float32: Callable[[str], bool] = lambda name: False,
    *,
    cast_buffers: bool = True,
) -> None:
    """Give ``module`` (built by ``build_empty``) the tensors of its files, mapped, not copied.

    ``stored`` maps each tensor's name in ``module`` to its file and its key there.
    Floating tensors are cast to ``dtype`` (a cast makes the one copy the module keeps;
    an equal dtype keeps the mapped tensor), except those ``keep_float32`` names;
    integer tensors keep theirs. Tied
    names get one shared tensor. Floating buffers that the files do not store are cast
    to ``dtype`` too, as ``module.to(dtype)`` would, unless ``cast_buffers`` is false:
    transformers keeps them as the class computed them (a rotary embedding's float32
    frequencies, which in bfloat16 would turn every position).

    Raises:
        ValueError: a parameter is in no file (the message names the missing ones).
    """
    groups: dict[int, list[str]] = {}
    for name, tensor in module.state_dict(keep_vars=True).items():
        groups.setdefault(id(tensor), []).append(name)
    modules = dict(module.named_modules(remove_duplicate=False))
    with ExitStack() as files, torch.no_grad():
        opened: dict[Path, _TensorFile] = {}
        for names in groups.values():
            found = next((name for name in names if name in stored), None)
            if found is None:
                continue
            path, key = stored[found]
            if path not in opened:
                opened[path] = files.enter_context(safe_open(path, framework="pt"))
            tensor = opened[path].get_tensor(key)
            if tensor.is_floating_point():
                tensor = tensor.to(torch.float32 if keep_float32(found) else dtype)
            _put(modules, names, tensor)
        for name, buffer in module.named_buffers() if cast_buffers else ():
            if buffer.is_floating_point() and buffer.dtype != dtype and not keep_float32(name):
                _put(modules, [name], buffer.to(dtype))
    left = [name for name, param in module.named_parameters() if param.device.type == "meta"]
    if left:
        shown = ", ".join(left[:5]) + (f" and {len(left) - 5} more" if len(left) > 5 else "")
        raise ValueError(f"no weights file holds {shown}; the folder's weights are incomplete")


class _TensorFile(Protocol):
    """The part of an open ``safe_open`` file used here (safetensors ships it untyped)."""

    def get_tensor(self, name: str) -> torch.Tensor: ...


def _put(modules: Mapping[str, nn.Module], names: list[str], tensor: torch.Tensor) -> None:
    """Set every one of ``names`` (a tie group) to one parameter or buffer holding ``tensor``.

    ``modules`` is the model's ``named_modules()`` (looked up once, not per name).
    """
    owner_name, _, leaf = names[0].rpartition(".")
    if leaf in modules[owner_name]._parameters:
        parameter = nn.Parameter(tensor, requires_grad=False)
        for name in names:
            owner_name, _, leaf = name.rpartition(".")
            modules[owner_name]._parameters[leaf] = parameter
        return
    for name in names:
        owner_name, _, leaf = name.rpartition(".")
        modules[owner_name]._buffers[leaf] = tensor
