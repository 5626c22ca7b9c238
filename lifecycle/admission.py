"""Admission: pure checks from a spec to the refusals that block it.

Nothing here touches a weight, a file or a device; each check returns every
refusal it finds so a whole pipeline is refused with all its reasons at once.
"""

from __future__ import annotations

from lifecycle.config import PipelineSpec
from lifecycle.refusals import Refusal


def layout_refusals(spec: PipelineSpec) -> list[Refusal]:
    """Return a ``parallel.invalid_layout`` refusal for each broken layout invariant."""
    return [
        Refusal(
            code="parallel.invalid_layout",
            component=spec.name,
            message=problem,
            hint="set [parallel] sp_degree = ulysses_degree x ring_degree x "
            "kv_gather_degree, and use kv_gather_degree > 1 only with "
            "ulysses_degree = ring_degree = 1",
        )
        for problem in spec.parallel.check()
    ]
