"""The generic loader: a component whose kind nobody registered."""

from __future__ import annotations

import importlib
from typing import ClassVar

from torch import nn

from components.loader import ComponentLoader, KindOptions
from components.sites import AttentionSite


class GenericOptions(KindOptions, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Options of a component of unknown kind.

    Attributes:
        factory: ``"package.module:callable"`` returning the ``nn.Module``.
    """

    factory: str


class GenericLoader(ComponentLoader):
    """Build an unknown kind from an import path; strict about attention.

    Its attention sites are unknown until it is built, so admission cannot
    plan them: the component scope enforces explicit backends at load, and an
    explicit global backend never falls back for it.
    """

    kind: ClassVar[str] = "generic"
    options_type = GenericOptions
    allows_global_fallback = False

    def sites(self) -> tuple[AttentionSite, ...] | None:
        """Return None: the sites are known only once the module is built."""
        return None

    def build_custom(self) -> nn.Module:
        """Import the factory and call it.

        Raises:
            ImportError: the module or callable cannot be imported.
            TypeError: the factory did not return an ``nn.Module``.
        """
        assert isinstance(self.options, GenericOptions)
        module_name, _, attribute = self.options.factory.partition(":")
        factory = getattr(importlib.import_module(module_name), attribute)
        built = factory()
        if not isinstance(built, nn.Module):
            raise TypeError(
                f"factory {self.options.factory!r} returned {type(built).__name__}, "
                "not an nn.Module"
            )
        return built
