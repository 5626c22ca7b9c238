"""The residency of a run's components over time, as a Mermaid gantt chart.

``run --timeline`` writes the chart; the status page draws the same intervals live.
"""

from __future__ import annotations

from collections.abc import Sequence

from lifecycle.events import Move

__all__ = ["residency_gantt", "resident_intervals"]

Interval = tuple[float, float, str | None]


def residency_gantt(
    title: str, components: Sequence[str], moves_by_rank: Sequence[Sequence[Move]]
) -> str:
    """Return a Mermaid gantt with one bar per interval a component spent resident.

    Args:
        title: the chart's title.
        components: the components, one section each (per rank), in this order.
        moves_by_rank: every move of the run on each rank, in the order they happened;
            with more than one rank each section is named ``rank R component``.
    """
    lines = ["gantt", f"    title {title}", "    dateFormat x", "    axisFormat %S.%L s"]
    several = len(moves_by_rank) > 1
    for rank, moves in enumerate(moves_by_rank):
        intervals = resident_intervals(components, moves)
        for component in components:
            section = f"rank {rank} {component}" if several else component
            lines.append(f"    section {section}")
            bar = f"r{rank}{component}" if several else component
            for index, (start, stop, request) in enumerate(intervals[component]):
                label = f"resident ({request})" if request else "resident"
                lines.append(f"    {label} :{bar}{index}, {_ms(start)}, {_ms(stop)}")
    return "\n".join(lines) + "\n"


def resident_intervals(
    components: Sequence[str], moves: Sequence[Move]
) -> dict[str, list[Interval]]:
    """Return each component's resident intervals: (start, stop, request id) in seconds.

    Each onload pairs with the next offload; intervals still open end at the last move.
    """
    end = moves[-1].at if moves else 0.0
    onloaded_at: dict[str, float] = {}
    intervals: dict[str, list[Interval]] = {c: [] for c in components}
    for move in moves:
        if move.direction == "onload":
            onloaded_at[move.component] = move.at
        elif move.component in onloaded_at:
            start = onloaded_at.pop(move.component)
            intervals[move.component].append((start, move.at, move.request_id))
    for component, start in onloaded_at.items():
        intervals[component].append((start, end, None))
    return intervals


def _ms(seconds: float) -> int:
    return round(seconds * 1000)
