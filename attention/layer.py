"""The attention layer components build: backend chosen once, armed only while resident."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from attention import registry
from attention.backend import AttentionImpl
from attention.errors import NotResidentError
from attention.override import REQUEST_BACKEND, UnpreparedBackendError
from attention.packing import Boundaries, PerSegmentVarlen, as_tensor
from attention.request import ComponentRequests
from attention.requirements import NO_REQUIREMENTS, AttentionRequirements
from attention.roles import AttentionRole
from attention.scope import UNSCOPED, AttentionScope, current_scope

__all__ = ["Attention", "arm_all", "arm_layers", "disarm_all", "disarm_layers", "find_layers"]

# B batch, H heads, S seq, D head dim, T packed tokens


class Attention(nn.Module):
    """Run one attention site's kernel, chosen once at construction from the current scope.

    Inside ``component_attention_scope`` the scope's requests, plan and platform decide
    the backend; outside one the layer takes its default, else the platform default,
    under the component name ``<unscoped>``. Layers start disarmed: the lifecycle arms
    them when their component becomes resident (``arm_layers``), and a forward on a
    disarmed layer raises ``NotResidentError``.

    Layout (see ``attention.backend``): dense q ``(B, Hq, Sq, D)``, k/v ``(B, Hk, Sk, D)``;
    packed q ``(Tq, Hq, D)``, k/v ``(Tk, Hk, D)`` with ``cu_seqlens`` boundaries.

    Args:
        site: the attention site the component declares this layer under.
        role: self- or cross-attention.
        requirements: what the layer needs; masks, varlen and the LSE may only be used
            when declared here, so that the choice of backend never changes what runs.
        supported: the backends the layer works with, or None for any.
        default: the layer's default backend, or None.
        backend: a backend the layer's code insists on (explicit), or None.
        scale: the softmax scale; None means ``1 / sqrt(D)``.

    Raises:
        BackendSelectionError: no backend may serve the layer (see ``select_backend``).
    """

    def __init__(
        self,
        site: str,
        role: AttentionRole,
        *,
        requirements: AttentionRequirements = NO_REQUIREMENTS,
        supported: frozenset[str] | None = None,
        default: str | None = None,
        backend: str | None = None,
        scale: float | None = None,
    ) -> None:
        super().__init__()
        scope = current_scope() or AttentionScope(ComponentRequests(component=UNSCOPED))
        request = scope.requests.for_site(
            site,
            role,
            requirements=requirements,
            supported=supported,
            default=default,
            backend=backend,
        )
        self.site = site
        self.role = role
        self.requirements = requirements
        self.scale = scale
        self.component = scope.component
        self.selection = scope.resolve(request)
        self.backend_name = self.selection.backend
        self._lse_allowed = requirements.softmax_lse or request.ring
        self._impl = registry.get(self.backend_name).make_impl(
            scope.requests.backend_options.get(self.backend_name)
        )
        self._armed = False

    @property
    def lse_allowed(self) -> bool:
        """Tell whether ``forward_with_lse`` may run: declared, or ring attention applies."""
        return self._lse_allowed

    @property
    def is_armed(self) -> bool:
        """Tell whether the layer may run (its component is resident)."""
        return self._armed

    def arm(self) -> None:
        """Let the layer run; the lifecycle calls this when the component becomes resident."""
        self._armed = True

    def disarm(self) -> None:
        """Stop the layer from running; called when the component leaves residency."""
        self._armed = False

    def forward(
        self,
        q: torch.Tensor,  # (B, Hq, Sq, D)
        k: torch.Tensor,  # (B, Hk, Sk, D)
        v: torch.Tensor,  # (B, Hk, Sk, D)
        *,
        attn_mask: torch.Tensor | None = None,
        bias: torch.Tensor | None = None,
        is_causal: bool = False,
    ) -> torch.Tensor:
        """Attend q to k and v; returns ``(B, Hq, Sq, D)``.

        At most one of ``attn_mask``, ``bias`` (a float added to the scores) and
        ``is_causal`` applies to a call: fold a padding mask into the bias.

        Raises:
            NotResidentError: the layer is disarmed.
            ValueError: a mask, bias or causal call whose requirement was not declared, or
                more than one of them.
        """
        if not self._armed:  # the one check on the hot path
            raise NotResidentError(self.component, self.site)
        impl = self._impl if self._switch is None else self._request_impl()
        if attn_mask is None and bias is None and not is_causal:
            return impl.forward(q, k, v, scale=self.scale)
        if (attn_mask is not None) + (bias is not None) + is_causal > 1:
            raise ValueError(
                f"layer '{self.site}' of component '{self.component}' was called with more "
                "than one of attn_mask, bias and is_causal; fold them into one bias"
            )
        if attn_mask is not None:
            if not self.requirements.attention_mask:
                raise self._undeclared("attention_mask", "an attn_mask")
            return impl.forward_masked(q, k, v, attn_mask, scale=self.scale)
        if bias is not None:
            if not self.requirements.additive_bias:
                raise self._undeclared("additive_bias", "a bias")
            return impl.forward_biased(q, k, v, bias, scale=self.scale)
        self._check_causal(is_causal)
        return impl.forward_causal(q, k, v, scale=self.scale)

    def forward_varlen(
        self,
        q: torch.Tensor,  # (Tq, Hq, D)
        k: torch.Tensor,  # (Tk, Hk, D)
        v: torch.Tensor,  # (Tk, Hk, D)
        cu_seqlens_q: Boundaries,
        cu_seqlens_k: Boundaries,
        max_seqlen_q: int,
        max_seqlen_k: int,
        *,
        is_causal: bool = False,
    ) -> torch.Tensor:
        """Attend each packed sequence to its own keys only; returns ``(Tq, Hq, D)``.

        The boundaries may be host integers: a kernel that attends sequence by sequence
        takes them as they are (no read of a tensor's values, which is a graph break under
        torch.compile), any other gets them as an int32 tensor on q's device.

        Raises:
            NotResidentError: the layer is disarmed.
            ValueError: ``packed_varlen`` (or, for a causal call, ``causal``) was not
                declared, or the boundaries are invalid.
        """
        if not self._armed:
            raise NotResidentError(self.component, self.site)
        if not self.requirements.packed_varlen:
            raise self._undeclared("packed_varlen", "packed sequences")
        self._check_causal(is_causal)
        impl = self._impl if self._switch is None else self._request_impl()
        if isinstance(impl, PerSegmentVarlen):  # sequence by sequence: host integers as they came
            return impl.forward_varlen(
                q,
                k,
                v,
                cu_seqlens_q,
                cu_seqlens_k,
                max_seqlen_q,
                max_seqlen_k,
                is_causal=is_causal,
                scale=self.scale,
            )
        cu_q, cu_k = as_tensor(cu_seqlens_q, q.device), as_tensor(cu_seqlens_k, q.device)
        return impl.forward_varlen(
            q, k, v, cu_q, cu_k, max_seqlen_q, max_seqlen_k, is_causal=is_causal, scale=self.scale
        )

    def forward_with_lse(
        self,
        q: torch.Tensor,  # (B, Hq, Sq, D)
        k: torch.Tensor,  # (B, Hk, Sk, D)
        v: torch.Tensor,  # (B, Hk, Sk, D)
        *,
        is_causal: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Attend and return the softmax log-sum-exp ``(B, Hq, Sq)`` too (ring attention).

        Raises:
            NotResidentError: the layer is disarmed.
            ValueError: neither ``softmax_lse`` was declared nor does ring attention apply,
                or a causal call did not declare ``causal``.
        """
        if not self._armed:
            raise NotResidentError(self.component, self.site)
        if not self._lse_allowed:
            raise self._undeclared("softmax_lse", "a request for the softmax LSE")
        self._check_causal(is_causal)
        impl = self._impl if self._switch is None else self._request_impl()
        return impl.forward_with_lse(q, k, v, is_causal=is_causal, scale=self.scale)

    # -- the per-request override (design §4.6) -----------------------------------

    _switch: dict[str, AttentionImpl] | None = None
    """A switchable layer's impls prepared per backend name; None on every other layer,
    so that their forward pays one attribute read for the feature."""

    @property
    def is_switchable(self) -> bool:
        """Tell whether a request's ``attention_backend`` may switch this layer."""
        return self._switch is not None

    @property
    def prepared_backends(self) -> frozenset[str]:
        """Return the backends this switchable layer has impls for (empty if not switchable)."""
        return frozenset(self._switch or ())

    def make_switchable(self) -> None:
        """Let requests switch this layer (its kind is switchable, its spec choice is not
        explicit); the lifecycle decides, at load."""
        if self._switch is None:
            self._switch = {}

    def add_prepared(self, name: str, impl: AttentionImpl) -> None:
        """Keep ``impl`` as this layer's kernel for requests that name ``name``.

        Raises:
            ValueError: the layer is not switchable.
        """
        if self._switch is None:
            raise ValueError(
                f"layer '{self.site}' of component '{self.component}' is not switchable; "
                "call make_switchable() first"
            )
        self._switch[name] = impl

    def _request_impl(self) -> AttentionImpl:
        target = REQUEST_BACKEND.get()
        if target is None or self._switch is None:
            return self._impl
        impl = self._switch.get(target)
        if impl is None:
            raise UnpreparedBackendError(self.component, self.site, target)
        return impl

    def extra_repr(self) -> str:
        """Show the site, role, backend and whether the layer is armed."""
        return (
            f"site={self.site!r}, role={self.role.value}, backend={self.backend_name!r}, "
            f"armed={self._armed}"
        )

    def _check_causal(self, is_causal: bool) -> None:
        if is_causal and not self.requirements.causal:
            raise self._undeclared("causal", "is_causal=True")

    def _undeclared(self, flag: str, what: str) -> ValueError:
        return ValueError(
            f"layer '{self.site}' of component '{self.component}' was called with {what}, "
            f"but it did not declare AttentionRequirements({flag}=True), so backend "
            f"'{self.backend_name}' was not chosen for it; declare the requirement"
        )


def find_layers(module: nn.Module) -> tuple[Attention, ...]:
    """Return every ``Attention`` layer under ``module`` (itself included), in module order.

    Walking a module costs a visit per submodule: find its layers once per built
    module, then arm and disarm that tuple on every move (``arm_all``, ``disarm_all``).
    """
    return tuple(m for m in module.modules() if isinstance(m, Attention))


def arm_all(layers: Iterable[Attention]) -> None:
    """Arm each of ``layers``."""
    for layer in layers:
        layer.arm()


def disarm_all(layers: Iterable[Attention]) -> None:
    """Disarm each of ``layers``."""
    for layer in layers:
        layer.disarm()


def arm_layers(module: nn.Module) -> int:
    """Arm every ``Attention`` layer under ``module`` (itself included); return how many."""
    layers = find_layers(module)
    arm_all(layers)
    return len(layers)


def disarm_layers(module: nn.Module) -> int:
    """Disarm every ``Attention`` layer under ``module`` (itself included); return how many."""
    layers = find_layers(module)
    disarm_all(layers)
    return len(layers)
