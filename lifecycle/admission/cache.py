"""Refuse a step cache nothing would honour, or one that could never skip (design §17).

A cache is an explicit component option: the loading path admitted for its component
must run it as written (``ComponentLoader.cache_problem``; a native class only through
diffusers' own hook, ``components.cache.native``), and the pipeline's default steps must
leave a step to skip once the warm-up and final steps are computed. A request asking for
fewer steps than that is not refused: it runs uncached and says so.
"""

from __future__ import annotations

from collections.abc import Mapping

from components.loader import ComponentLoader, LoaderPath
from lifecycle.refusals import Refusal, RefusalCode
from lifecycle.spec.structs import PipelineSpec

__all__ = ["cache_refusals"]


def cache_refusals(
    spec: PipelineSpec,
    loaders: Mapping[str, ComponentLoader],
    paths: Mapping[str, LoaderPath | None],
    default_steps: int,
) -> list[Refusal]:
    """Refuse every component cache its path cannot run or its pipeline's steps leave idle.

    ``paths`` are the admitted loading paths (None: none was admitted, and that is
    refused already); ``default_steps`` are the steps of a request that names none.
    """
    found = []
    for name, component in spec.components.items():
        settings = component.cache_settings
        path = paths.get(name)
        if settings is None or path is None:
            continue
        problem = loaders[name].cache_problem(path, settings)
        if problem is not None:
            found.append(
                Refusal(
                    code=RefusalCode.CACHE_UNSUPPORTED,
                    component=name,
                    message=f"component '{name}' has a {settings.method} step cache, but {problem}",
                    hint=f"remove [components.{name}.cache]"
                    + (
                        ""
                        if path == "custom"
                        else ', or load it through the custom path (loader = "custom")'
                    ),
                )
            )
        elif not settings.skips_in(default_steps):
            found.append(
                Refusal(
                    code=RefusalCode.CACHE_STEPS,
                    component=name,
                    message=f"component '{name}' computes warmup_steps "
                    f"({settings.warmup_steps}) + final_steps ({settings.final_steps}) of "
                    f"every request, and the pipeline's default of {default_steps} steps "
                    "leaves none for its step cache to skip",
                    hint=f"make components.{name}.cache.warmup_steps + final_steps "
                    f"less than {default_steps}",
                )
            )
    return found
