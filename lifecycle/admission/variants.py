"""Variant weight files: a folder component holds the variant its spec asks for, or is refused.

A hub repository may ship a component's weights twice, in full precision and as a
variant (``model.fp16.safetensors``). The spec's ``variant`` picks one; a component
whose folder lacks it is refused here, naming the files it has, rather than read from
other files than the ones asked for (or refused twice, by each loading path).
"""

from __future__ import annotations

from components.folders.files import VariantError, weight_files
from components.folders.loader import FolderLoader
from components.loader import ComponentLoader
from lifecycle.refusals import Refusal, RefusalCode

__all__ = ["variant_refusals"]


def variant_refusals(name: str, loader: ComponentLoader) -> list[Refusal]:
    """Refuse a folder component whose folder has no safetensors of the variant asked for
    (or, with none asked, only variant ones).

    Any other problem with its files is the loader path's refusal, not this one.
    """
    if not isinstance(loader, FolderLoader):
        return []
    try:
        weight_files(loader.folder, loader.options.variant)
    except VariantError as err:
        return [
            Refusal(
                code=RefusalCode.LOADER_UNAVAILABLE,
                component=name,
                message=str(err),
                hint=_hint(name, err),
            )
        ]
    except (OSError, ValueError):
        pass  # missing or broken files: the loader path says so
    return []


def _hint(name: str, err: VariantError) -> str:
    """Say which variants ``name``'s folder has, and where to ask for one."""
    has = [f'variant "{v}"' for v in err.variants if v is not None]
    unset = None in err.variants
    text = " or ".join(has + (["no variant"] if unset else []))
    return (
        f"'{name}' has {text}: set variant to one it has (at top level for every component, "
        f"in [components.{name}.options] for it alone)"
        + (", or leave both unset to read its files without one" if unset else "")
    )
