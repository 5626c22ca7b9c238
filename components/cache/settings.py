"""``[components.NAME.cache]``: which step cache a denoiser runs, and its settings (design §17).

A step cache skips work between denoising steps whose inputs barely changed:

- ``first_block`` runs the first block of the stack every step and compares the change
  of its output residual with the last computed step's (relative L1); below
  ``threshold`` the other blocks are skipped and their residual from that step reused;
- ``taylor_seer`` computes the whole stack every ``interval`` steps and in between
  predicts its output residual by a Taylor expansion of ``order`` in the step index
  (divided differences of the computed steps).

Both compute the first ``warmup_steps`` and the last ``final_steps`` of a request, and
never skip more than ``max_skipped`` steps in a row.
"""

from __future__ import annotations

from typing import Annotated, Literal, TypeAlias

import msgspec
from msgspec import UNSET, UnsetType

__all__ = ["CacheMethod", "CacheSettings"]

CacheMethod: TypeAlias = Literal["first_block", "taylor_seer"]

DEFAULT_THRESHOLD = 0.08
"""first_block: the relative L1 change below which a step is skipped (cache-dit's default
residual threshold; diffusers' FirstBlockCache takes 0.05)."""
DEFAULT_INTERVAL = 4
"""taylor_seer: a full step every 4 steps, predictions for the 3 between."""
DEFAULT_ORDER = 1
"""taylor_seer: first-order (linear) prediction, diffusers' ``max_order`` default."""
MAX_ORDER = 4

_METHOD_KEYS: dict[CacheMethod, tuple[str, ...]] = {
    "first_block": ("threshold",),
    "taylor_seer": ("interval", "order"),
}
COMMON_KEYS = ("warmup_steps", "final_steps", "max_skipped")


class CacheSettings(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """One component's step cache (``[components.NAME.cache]``).

    Attributes:
        method: ``first_block`` or ``taylor_seer``.
        warmup_steps: the first steps of a request, always computed.
        final_steps: the last steps of a request, always computed.
        max_skipped: the most steps skipped in a row (unset: no bound beyond the method's).
        threshold: first_block only: the relative L1 change of the first block's output
            residual below which the other blocks are skipped.
        interval: taylor_seer only: a full step every ``interval`` steps.
        order: taylor_seer only: the order of the Taylor expansion (0 reuses the last
            computed output residual as it is).

    Raises:
        ValueError: a key of the other method was given (a ``msgspec.ValidationError``
            when decoded).
    """

    method: CacheMethod
    warmup_steps: Annotated[int, msgspec.Meta(ge=0)] = 2
    final_steps: Annotated[int, msgspec.Meta(ge=0)] = 1
    max_skipped: Annotated[int, msgspec.Meta(ge=1)] | UnsetType = UNSET
    threshold: Annotated[float, msgspec.Meta(gt=0, le=1)] | UnsetType = UNSET
    interval: Annotated[int, msgspec.Meta(ge=2)] | UnsetType = UNSET
    order: Annotated[int, msgspec.Meta(ge=0, le=MAX_ORDER)] | UnsetType = UNSET

    def __post_init__(self) -> None:
        for method, keys in _METHOD_KEYS.items():
            if method == self.method:
                continue
            given = [key for key in keys if not isinstance(getattr(self, key), UnsetType)]
            if given:
                own = ", ".join((*COMMON_KEYS, *_METHOD_KEYS[self.method]))
                raise ValueError(
                    f"{', '.join(given)} {'is a key' if len(given) == 1 else 'are keys'} of "
                    f'method "{method}", not of "{self.method}" (which takes {own}); drop '
                    f'{"it" if len(given) == 1 else "them"} or set method = "{method}"'
                )

    @property
    def threshold_value(self) -> float:
        """Return first_block's threshold, the default when none was written."""
        return DEFAULT_THRESHOLD if isinstance(self.threshold, UnsetType) else self.threshold

    @property
    def interval_value(self) -> int:
        """Return taylor_seer's interval, the default when none was written."""
        return DEFAULT_INTERVAL if isinstance(self.interval, UnsetType) else self.interval

    @property
    def order_value(self) -> int:
        """Return taylor_seer's order, the default when none was written."""
        return DEFAULT_ORDER if isinstance(self.order, UnsetType) else self.order

    @property
    def max_skipped_value(self) -> int | None:
        """Return the most steps skipped in a row, None for no bound."""
        return None if isinstance(self.max_skipped, UnsetType) else self.max_skipped

    @property
    def always_computed(self) -> int:
        """Return the steps of every request that are always computed (warm-up and final)."""
        return self.warmup_steps + self.final_steps

    def skips_in(self, steps: int) -> bool:
        """Tell whether a request of ``steps`` steps leaves any step the cache may skip."""
        return steps > self.always_computed

    def uncached_reason(self, steps: int) -> str | None:
        """Say why a request of ``steps`` steps runs uncached, or None when it may skip."""
        if self.skips_in(steps):
            return None
        return (
            f"{steps} step{'s' if steps != 1 else ''} leave nothing to skip: warmup_steps "
            f"({self.warmup_steps}) + final_steps ({self.final_steps}) are always computed"
        )

    def describe(self) -> str:
        """Return the settings in one line, every default spelled out (``check``'s table)."""
        if self.method == "first_block":
            own = f"threshold {self.threshold_value:g}"
        else:
            own = f"interval {self.interval_value}, order {self.order_value}"
        bound = self.max_skipped_value
        skipped = "" if bound is None else f", max {bound} skipped"
        return (
            f"{self.method} ({own}; warmup {self.warmup_steps}, final {self.final_steps}{skipped})"
        )

    def resolved(self) -> CacheSettings:
        """Return these settings with the method's defaults written out (``check --json``)."""
        if self.method == "first_block":
            return msgspec.structs.replace(self, threshold=self.threshold_value)
        return msgspec.structs.replace(self, interval=self.interval_value, order=self.order_value)
