"""Optional libraries: whether one is here, and the classes a folder may name from it.

diffusers and transformers (the ``diffusers`` extra) are imported only when a folder's
component is sized, built or run, never when the project is imported: importing them
takes seconds, and the reference kinds work without them.
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import Literal, TypeAlias

__all__ = ["EXTRA", "Library", "is_importable", "library_class", "missing"]

Library: TypeAlias = Literal["diffusers", "transformers"]
EXTRA = "diffusers"
"""The project's extra that installs both libraries."""


def is_importable(module: str) -> bool:
    """Tell whether ``module`` can be imported here, without importing it.

    A finder that blocks the module (raising ``ImportError``, as tests do to hide an
    optional library) counts as not importable.
    """
    try:
        return importlib.util.find_spec(module) is not None
    except ImportError:
        return False


def missing(library: Library) -> str | None:
    """Say that ``library`` is not installed and how to install it; None when it is."""
    if is_importable(library):
        return None
    return f"the {library} package is not installed (pip install 'pipeline-lifecycle[{EXTRA}]')"


def library_class(library: Library, name: str, base: str) -> type:
    """Return the class ``name`` of ``library`` after checking it derives from ``base``.

    ``base`` is a class of the same library (``ModelMixin``, ``PreTrainedModel``,
    ``SchedulerMixin``, ``PreTrainedTokenizerBase``): a folder may only name classes of
    the role it uses them in, never any attribute of the library.

    Raises:
        ModuleNotFoundError: the library is not installed.
        ValueError: the library has no such class, or it is not a ``base``.
    """
    module = importlib.import_module(library)
    found = getattr(module, name, None)
    if not (isinstance(found, type) and issubclass(found, getattr(module, base))):
        raise ValueError(f"{library} has no {base} class named '{name}'")
    return found
