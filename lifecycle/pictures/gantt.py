"""The residency of a run's components over time, as a Mermaid gantt chart.

``run --timeline`` writes the chart; the status page draws the same intervals live.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from lifecycle.events import Move

__all__ = ["Interval", "residency_gantt", "resident_intervals"]


class Interval(NamedTuple):
    """One stretch of a component on the device.

    Attributes:
        start: when it was onloaded (seconds since its pipeline started).
        stop: when it was offloaded (the last move's time, for one still resident).
        request_id: the request its offload happened for, if any.
        prefetched: its onload came ahead of its use, for the next request (a move's
            ``reason`` ``prefetch``).
    """

    start: float
    stop: float
    request_id: str | None
    prefetched: bool = False


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
            for index, (start, stop, request, prefetched) in enumerate(intervals[component]):
                label = "prefetched, resident" if prefetched else "resident"
                label += f" ({request})" if request else ""
                lines.append(f"    {label} :{bar}{index}, {_ms(start)}, {_ms(stop)}")
    return "\n".join(lines) + "\n"


def resident_intervals(
    components: Sequence[str], moves: Sequence[Move]
) -> dict[str, list[Interval]]:
    """Return each component's resident intervals, in seconds.

    Each onload pairs with the next offload; intervals still open end at the last move.
    """
    end = moves[-1].at if moves else 0.0
    onloads: dict[str, Move] = {}
    intervals: dict[str, list[Interval]] = {c: [] for c in components}
    for move in moves:
        if move.direction == "onload":
            onloads[move.component] = move
        elif move.component in onloads:
            onload = onloads.pop(move.component)
            prefetched = onload.reason == "prefetch"
            interval = Interval(onload.at, move.at, move.request_id, prefetched)
            intervals[move.component].append(interval)
    for component, onload in onloads.items():
        intervals[component].append(Interval(onload.at, end, None, onload.reason == "prefetch"))
    return intervals


def _ms(seconds: float) -> int:
    return round(seconds * 1000)
