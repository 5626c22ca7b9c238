"""Which step caches diffusers' own cache hook runs as written (design §17): a pure decision.

A native class honours a cache through diffusers' ``CacheMixin.enable_cache`` or not at
all, and only where diffusers' hook does what the settings say. Diffusers'
``FirstBlockCache`` (``FirstBlockCacheConfig(threshold)``) measures the relative L1 change
of the first block's output residual as ours does, and:

- computes the first step (it has nothing to compare with) and may skip every one after
  it: our ``warmup_steps`` 0 and 1 do the same, a larger warm-up it cannot do;
- computes no final step: ``final_steps`` must be 0;
- skips any number of steps in a row: ``max_skipped`` must be unset.

Its ``TaylorSeerCache`` is another method (it predicts each attention and feed-forward
output, not the stack's output residual), so ``taylor_seer`` has no native hook.
"""

from __future__ import annotations

from components.cache.settings import CacheSettings

__all__ = ["hook_problem"]

HOOK_WARMUP = 1
"""The most warm-up steps diffusers' FirstBlockCache matches: it computes the first step."""


def hook_problem(settings: CacheSettings, class_name: str, hooked: bool) -> str | None:
    """Say why diffusers' ``class_name`` cannot run ``settings`` through its own cache hook,
    or None when ``FirstBlockCacheConfig(threshold)`` does exactly what they say.

    ``hooked``: whether the class has diffusers' cache hooks (``CacheMixin``).
    """
    runs = f"its native path runs diffusers' {class_name}"
    if not hooked:
        return f"{runs}, which has no cache hook (diffusers' CacheMixin)"
    if settings.method != "first_block":
        return (
            f'{runs}, whose cache hook runs method = "first_block" only (diffusers\' '
            "TaylorSeerCache predicts each attention and feed-forward output, not the "
            f'stack\'s): set method = "first_block"'
        )
    fixes = []
    if settings.warmup_steps > HOOK_WARMUP:
        fixes.append(
            f"warmup_steps = {HOOK_WARMUP} (it is {settings.warmup_steps}: diffusers' "
            "FirstBlockCache computes only the first step before it may skip)"
        )
    if settings.final_steps:
        fixes.append(
            f"final_steps = 0 (it is {settings.final_steps}: diffusers' FirstBlockCache "
            "computes no final step)"
        )
    bound = settings.max_skipped_value
    if bound is not None:
        fixes.append(
            f"no max_skipped (it is {bound}: diffusers' FirstBlockCache skips any number of "
            "steps in a row)"
        )
    if not fixes:
        return None
    return f"{runs}, whose FirstBlockCache cannot do these settings: set {'; '.join(fixes)}"
