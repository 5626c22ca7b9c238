"""The names a folder's tensors take in the module, as the library renames older ones on load.

Checkpoints written by older library versions name some tensors differently from
today's classes: transformers 5 keeps ``CLIPTextModel``'s layers without the
``text_model.`` prefix its 4.x checkpoints carry, and diffusers renamed the attention
of old VAE checkpoints (``query`` -> ``to_q``). Each library says how it renames when
it loads; the same renaming is asked of it here, so a folder loads as it would there.
"""

from __future__ import annotations

from collections.abc import Iterable

from torch import nn

from components.libraries import Library

__all__ = ["module_names"]


def module_names(library: Library, module: nn.Module, keys: Iterable[str]) -> dict[str, str]:
    """Return each stored tensor's name in ``module`` -> its key in the files.

    ``module`` is the empty model (built on ``meta``) the keys will be loaded into.

    Raises:
        ValueError: a tensor needs more than a new name (transformers would convert it,
            merging or splitting tensors), which this version does not do.
    """
    keys = list(keys)
    if library == "transformers":
        return _transformers_names(module, keys)
    names = {key: key for key in keys}
    fix = getattr(module, "_fix_state_dict_keys_on_load", None)
    if fix is not None:
        fix(names)  # renames the keys of the dict in place; the values keep the stored key
    return names


def _transformers_names(module: nn.Module, keys: list[str]) -> dict[str, str]:
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key

    transforms = get_model_conversion_mapping(module)  # type: ignore[arg-type]
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    state = module.state_dict()
    prefix = getattr(module, "base_model_prefix", None)
    names = {}
    for key in keys:
        name, converter = rename_source_key(key, renamings, converters, prefix, state)
        if converter is not None:
            raise ValueError(
                f"tensor '{key}' is stored in an older layout that transformers converts "
                f"({converter}); re-save the folder with transformers 5 (save_pretrained)"
            )
        names[name] = key
    return names
