"""The generic loader: a kind an installed package registers as a plain factory."""

from __future__ import annotations

from collections.abc import Callable
from typing import ClassVar

from torch import nn

from components.loader import ComponentLoader, KindOptions
from components.sites import AttentionSite

__all__ = ["GenericLoader"]

ModuleFactory = Callable[[], nn.Module]


class GenericLoader(ComponentLoader):
    """Build a kind from the factory its package registered; strict about attention.

    A package's entry point may name a plain callable that returns an
    ``nn.Module`` instead of a ``ComponentLoader``; the registry then makes a
    subclass of this under the entry point's name (``for_factory``). Its
    attention sites are unknown until it is built, so admission cannot plan
    them: the component scope enforces explicit backends at load, and an
    explicit global backend never falls back for it. It takes no options but
    ``weights``.
    """

    kind: ClassVar[str] = "generic"
    options_type = KindOptions
    allows_global_fallback = False
    factory: ClassVar[ModuleFactory]

    @classmethod
    def for_factory(cls, kind: str, factory: ModuleFactory) -> type[GenericLoader]:
        """Return the loader of ``kind``, built by calling ``factory``."""
        return type(
            f"GenericLoader[{kind}]",
            (cls,),
            {"kind": kind, "factory": staticmethod(factory), "__module__": __name__},
        )

    def sites(self) -> tuple[AttentionSite, ...] | None:
        """Return None: the sites are known only once the module is built."""
        return None

    def build_custom(self) -> nn.Module:
        """Call the registered factory.

        Raises:
            TypeError: the factory did not return an ``nn.Module``.
        """
        built = type(self).factory()
        if not isinstance(built, nn.Module):
            raise TypeError(
                f"the factory of kind '{self.kind}' returned {type(built).__name__}, "
                "not an nn.Module"
            )
        return built
