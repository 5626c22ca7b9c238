"""Step caches of a denoiser: settings, per-row state and decisions (design §17)."""

from components.cache.settings import CacheMethod, CacheSettings
from components.cache.stack import CachedStack, run_cached
from components.cache.state import CacheSteps, RowCache, StepCache, count_steps, step_rows

__all__ = [
    "CacheMethod",
    "CacheSettings",
    "CacheSteps",
    "CachedStack",
    "RowCache",
    "StepCache",
    "count_steps",
    "run_cached",
    "step_rows",
]
