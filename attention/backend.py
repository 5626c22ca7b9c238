"""The two base classes every backend is made of: the kernel and its description.

Tensor layout, for every implementation:

- dense: q ``(B, Hq, Sq, D)``, k and v ``(B, Hk, Sk, D)``, out ``(B, Hq, Sq, D)``, the
  layout of ``torch.nn.functional.scaled_dot_product_attention``; ``Hq`` is a multiple of
  ``Hk`` (grouped-query attention when ``Hk < Hq``); causal attention (``forward_causal``,
  ``is_causal``) masks key ``j > i`` for query ``i`` (top-left aligned, as SDPA does); a
  mask is boolean (True takes part) or additive (0 / -inf), a bias any float added to the
  scores, both broadcastable to ``(B, Hq, Sq, Sk)``;
- packed varlen: q ``(Tq, Hq, D)``, k and v ``(Tk, Hk, D)``, sequence ``i`` spans rows
  ``cu_seqlens[i]:cu_seqlens[i + 1]``; out ``(Tq, Hq, D)``;
- softmax LSE: ``(B, Hq, Sq)``, float32 or wider, the natural log of each row's sum of
  exponentiated scaled scores.
"""

from __future__ import annotations

from typing import ClassVar, Literal, TypeAlias

import msgspec
import torch

from attention.requirements import AttentionRequirements

__all__ = ["AttentionBackend", "AttentionImpl", "DeviceKind", "NoOptions"]

# B batch, H heads, S seq, D head dim, T packed tokens

DeviceKind: TypeAlias = Literal["cpu", "cuda"]


class NoOptions(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Validate ``[attention.backend_options.<name>]`` of a backend that takes none."""


class AttentionImpl:
    """Run one attention kernel; subclasses override the optional methods they implement.

    A capability is granted by overriding its method and nothing else: ``forward_causal``
    (causal attention), ``forward_masked`` (attention masks), ``forward_biased`` (an
    additive float bias), ``forward_varlen`` (packed sequences), ``forward_with_lse`` (the
    softmax log-sum-exp). The base versions raise ``NotImplementedError``.

    ``forward_varlen`` and ``forward_with_lse`` take ``is_causal`` as their kernels do; a
    layer passes True only on a site that declared ``causal``, which only backends that
    override ``forward_causal`` serve.

    Args:
        options: the backend's validated options, an instance of its ``options_type``.
    """

    traceable: ClassVar[bool] = True
    """Whether dynamo can trace the kernel's calls into a graph (``compile = "whole"``): a
    kernel in a library dynamo cannot see into says False, and a component compiled whole
    refuses it when it is asked for explicitly (design §17)."""

    def __init__(self, options: msgspec.Struct) -> None:
        self.options = options

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        scale: float | None,
    ) -> torch.Tensor:
        """Attend q to k and v without a mask; ``scale`` None means ``1 / sqrt(D)``."""
        raise NotImplementedError

    def forward_causal(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        scale: float | None,
    ) -> torch.Tensor:
        """Attend causally (query ``i`` sees keys ``j <= i``) with the kernel's causal mode."""
        raise NotImplementedError(f"{type(self).__name__} does not implement causal attention")

    def forward_masked(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        attn_mask: torch.Tensor,
        *,
        scale: float | None,
    ) -> torch.Tensor:
        """Attend q to k and v under a boolean or additive mask."""
        raise NotImplementedError(f"{type(self).__name__} does not implement attention masks")

    def forward_biased(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        bias: torch.Tensor,
        *,
        scale: float | None,
    ) -> torch.Tensor:
        """Attend q to k and v with a float ``bias`` added to the scaled scores."""
        raise NotImplementedError(
            f"{type(self).__name__} does not implement an additive attention bias"
        )

    def forward_varlen(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cu_seqlens_q: torch.Tensor,
        cu_seqlens_k: torch.Tensor,
        max_seqlen_q: int,
        max_seqlen_k: int,
        *,
        is_causal: bool,
        scale: float | None,
    ) -> torch.Tensor:
        """Attend each packed query sequence to its own key sequence only."""
        raise NotImplementedError(
            f"{type(self).__name__} does not implement packed varlen attention"
        )

    def forward_with_lse(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        is_causal: bool,
        scale: float | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Attend without a mask and also return the softmax log-sum-exp ``(B, Hq, Sq)``."""
        raise NotImplementedError(f"{type(self).__name__} does not implement softmax LSE")


def _overrides(impl_cls: type[AttentionImpl], method: str) -> bool:
    return getattr(impl_cls, method) is not getattr(AttentionImpl, method)


class AttentionBackend:
    """Describe a backend: its name, its kernel class, its options and where it runs.

    Capabilities are read from ``impl_cls``: a backend supports what its implementation
    overrides. Subclasses set ``name`` and ``impl_cls``, and may set ``options_type``,
    ``is_sparse`` (an approximation of dense attention: never used for cross-attention
    and never chosen by a fallback), ``is_automatic`` (False keeps a backend out of every
    fallback chain) and ``unavailable_reason``.
    """

    name: ClassVar[str]
    impl_cls: ClassVar[type[AttentionImpl]]
    options_type: ClassVar[type[msgspec.Struct]] = NoOptions
    is_sparse: ClassVar[bool] = False
    is_automatic: ClassVar[bool] = True

    @classmethod
    def supports_varlen(cls) -> bool:
        """Tell whether the implementation overrides ``forward_varlen``."""
        return _overrides(cls.impl_cls, "forward_varlen")

    @classmethod
    def supports_lse(cls) -> bool:
        """Tell whether the implementation overrides ``forward_with_lse``."""
        return _overrides(cls.impl_cls, "forward_with_lse")

    @classmethod
    def supports_mask(cls) -> bool:
        """Tell whether the implementation overrides ``forward_masked``."""
        return _overrides(cls.impl_cls, "forward_masked")

    @classmethod
    def supports_bias(cls) -> bool:
        """Tell whether the implementation overrides ``forward_biased``."""
        return _overrides(cls.impl_cls, "forward_biased")

    @classmethod
    def supports_causal(cls) -> bool:
        """Tell whether the implementation overrides ``forward_causal``."""
        return _overrides(cls.impl_cls, "forward_causal")

    @classmethod
    def unsupported_requirements(cls, requirements: AttentionRequirements) -> tuple[str, ...]:
        """Name, in words, every requirement this backend's implementation cannot meet."""
        missing = AttentionRequirements(
            packed_varlen=requirements.packed_varlen and not cls.supports_varlen(),
            softmax_lse=requirements.softmax_lse and not cls.supports_lse(),
            attention_mask=requirements.attention_mask and not cls.supports_mask(),
            additive_bias=requirements.additive_bias and not cls.supports_bias(),
            causal=requirements.causal and not cls.supports_causal(),
        )
        return missing.words()

    @classmethod
    def unavailable_reason(cls, kind: DeviceKind) -> str | None:
        """Say why this backend cannot run on a ``kind`` device, or None when it can."""
        return None

    @classmethod
    def make_impl(cls, options: msgspec.Struct | None = None) -> AttentionImpl:
        """Build the kernel with ``options`` (the defaults of ``options_type`` when None).

        Raises:
            TypeError: ``options`` is not an instance of this backend's ``options_type``.
        """
        chosen = cls.options_type() if options is None else options
        if not isinstance(chosen, cls.options_type):
            raise TypeError(
                f"backend '{cls.name}' takes options of type {cls.options_type.__name__}, "
                f"got {type(chosen).__name__}; decode them with "
                f"msgspec.convert(raw, registry.get('{cls.name}').options_type)"
            )
        return cls.impl_cls(chosen)
