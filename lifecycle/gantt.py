"""The residency of a run's components over time, as a Mermaid gantt chart."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from lifecycle.residency import Move


def residency_gantt(
    title: str, components: Sequence[str], moves: Iterable[Move], end: float
) -> str:
    """Return a Mermaid gantt with one bar per interval a component spent resident.

    Args:
        title: the chart's title.
        components: the components, one section each, in this order.
        moves: every move of the run, in the order they happened.
        end: seconds since the orchestrator started at which open intervals close.
    """
    onloaded_at: dict[str, float] = {}
    intervals: dict[str, list[tuple[float, float, str | None]]] = {c: [] for c in components}
    for move in moves:
        if move.direction == "onload":
            onloaded_at[move.component] = move.at
        elif move.component in onloaded_at:
            start = onloaded_at.pop(move.component)
            intervals[move.component].append((start, move.at, move.request_id))
    for component, start in onloaded_at.items():
        intervals[component].append((start, end, None))
    lines = ["gantt", f"    title {title}", "    dateFormat x", "    axisFormat %S.%L s"]
    for component in components:
        lines.append(f"    section {component}")
        for index, (start, stop, request) in enumerate(intervals[component]):
            label = f"resident ({request})" if request else "resident"
            lines.append(f"    {label} :{component}{index}, {_ms(start)}, {_ms(stop)}")
    return "\n".join(lines) + "\n"


def _ms(seconds: float) -> int:
    return round(seconds * 1000)
