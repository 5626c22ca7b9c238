"""The drawn lifecycles, read back from their SVG: every edge joins the boxes it names.

The geometry is read off the markup alone (no renderer): each state's box, each edge's
path sampled about every pixel along its lines and curves, and each label's box from
its text, the monospace advance and the white halo drawn behind it.
"""

from __future__ import annotations

import itertools
import math
import re
import xml.etree.ElementTree as ET
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import pytest

from lifecycle.machines.adapter import AdapterMachine
from lifecycle.machines.component import LifecycleMachine
from lifecycle.machines.engine import GuardedMachine
from lifecycle.machines.pipeline import PipelineMachine
from lifecycle.machines.tables import (
    ADAPTER_TRANSITIONS,
    PIPELINE_TRANSITIONS,
    TRANSITIONS,
    WORKER_TRANSITIONS,
    TransitionRule,
)
from lifecycle.machines.worker import WorkerMachine
from lifecycle.pictures import diagrams
from lifecycle.pictures.svg import CHAR_PX

SVG = "{http://www.w3.org/2000/svg}"
HALO_PX = 2
"""Half the width of the white stroke behind a label (``.label`` in the style)."""
LINE_PX = 14
ASCENT_PX = 11
"""A 12 px monospace line's height and the part above its baseline, as Chromium lays
out the style's fonts."""
TOLERANCE_PX = 0.5

Point = tuple[float, float]


@dataclass(frozen=True)
class Box:
    """An axis-aligned rectangle."""

    left: float
    top: float
    right: float
    bottom: float

    def holds(self, point: Point, inset: float = TOLERANCE_PX) -> bool:
        """Say whether ``point`` lies inside, more than ``inset`` from the border."""
        x, y = point
        return (
            self.left + inset < x < self.right - inset
            and self.top + inset < y < self.bottom - inset
        )

    def borders(self, point: Point) -> bool:
        """Say whether ``point`` lies on the border, within the tolerance."""
        return self.holds(point, -TOLERANCE_PX) and not self.holds(point)

    def meets(self, other: Box) -> bool:
        """Say whether the two rectangles overlap."""
        return (
            self.left < other.right
            and other.left < self.right
            and self.top < other.bottom
            and other.top < self.bottom
        )


@dataclass(frozen=True)
class Drawn:
    """One transition as drawn: the states it joins, its trigger, its path and label."""

    source: str
    dest: str
    trigger: str
    points: tuple[Point, ...]
    label: Box


def _sample(d: str) -> tuple[Point, ...]:
    """Return points about a pixel apart along an absolute M/L/Q/C path."""
    tokens = re.findall(r"[MLQC]|-?\d+(?:\.\d+)?", d)
    points: list[Point] = []
    command = ""
    numbers: list[float] = []

    def flush() -> None:
        if command == "M":
            points.append((numbers[0], numbers[1]))
            return
        controls = [points[-1]] + [(numbers[i], numbers[i + 1]) for i in range(0, len(numbers), 2)]
        reach = sum(math.dist(a, b) for a, b in itertools.pairwise(controls))
        steps = max(2, math.ceil(reach))
        for step in range(1, steps + 1):
            points.append(_bezier(controls, step / steps))

    for token in tokens:
        if token.isalpha():
            if command:
                flush()
            command, numbers = token, []
        else:
            numbers.append(float(token))
    flush()
    return tuple(points)


def _bezier(controls: Sequence[Point], t: float) -> Point:
    """Return the point at ``t`` of the Bézier curve (a line, quadratic or cubic)."""
    while len(controls) > 1:  # de Casteljau
        controls = [
            (a[0] + (b[0] - a[0]) * t, a[1] + (b[1] - a[1]) * t)
            for a, b in itertools.pairwise(controls)
        ]
    return controls[0]


def _label_box(text: ET.Element) -> Box:
    """Return a label's box, halo included: placed by its anchor and baseline, turned
    about its own point when rotated."""
    x, y = float(text.get("x", 0)), float(text.get("y", 0))
    width = len(text.text or "") * CHAR_PX
    before = {"start": 0.0, "middle": width / 2, "end": width}[text.get("text-anchor", "start")]
    above = LINE_PX / 2 if text.get("dominant-baseline") == "central" else ASCENT_PX
    corners = [
        (dx, dy)
        for dx in (-before - HALO_PX, width - before + HALO_PX)
        for dy in (-above - HALO_PX, LINE_PX - above + HALO_PX)
    ]
    turn = re.fullmatch(r"rotate\((-?\d+) (\S+) (\S+)\)", text.get("transform", "rotate(0 0 0)"))
    assert turn is not None
    angle = math.radians(float(turn.group(1)))
    cx, cy = float(turn.group(2)) - x, float(turn.group(3)) - y
    cos, sin = round(math.cos(angle)), round(math.sin(angle))  # quarter turns only
    turned = [
        (x + cx + (dx - cx) * cos - (dy - cy) * sin, y + cy + (dx - cx) * sin + (dy - cy) * cos)
        for dx, dy in corners
    ]
    xs, ys = [p[0] for p in turned], [p[1] for p in turned]
    return Box(min(xs), min(ys), max(xs), max(ys))


def _read(svg: str) -> tuple[dict[str, Box], list[Drawn], list[tuple[Point, ...]]]:
    """Return the state boxes, the transitions and every edge path of a drawing."""
    root = ET.fromstring(svg)
    boxes = {}
    drawn = []
    for group in root.iter(f"{SVG}g"):
        if group.get("class") == "state":
            rect = group.find(f"{SVG}rect")
            assert rect is not None
            left, top = float(rect.get("x", 0)), float(rect.get("y", 0))
            width, height = float(rect.get("width", 0)), float(rect.get("height", 0))
            boxes[group.get("data-state", "")] = Box(left, top, left + width, top + height)
        elif group.get("class") == "transition":
            path, text = group.find(f"{SVG}path"), group.find(f"{SVG}text")
            assert path is not None
            assert text is not None
            drawn.append(
                Drawn(
                    source=group.get("data-source", ""),
                    dest=group.get("data-dest", ""),
                    trigger=text.text or "",
                    points=_sample(path.get("d", "")),
                    label=_label_box(text),
                )
            )
    edges = [_sample(p.get("d", "")) for p in root.iter(f"{SVG}path") if p.get("class") == "edge"]
    return boxes, drawn, edges


MACHINES: dict[str, tuple[GuardedMachine, Sequence[TransitionRule[Any]]]] = {
    "component": (LifecycleMachine(), TRANSITIONS),
    "pipeline": (PipelineMachine("pipelines"), PIPELINE_TRANSITIONS),
    "worker": (WorkerMachine("worker"), WORKER_TRANSITIONS),
    "adapter": (AdapterMachine("adapters"), ADAPTER_TRANSITIONS),
}


DRAWINGS = [
    pytest.param(name, upright, id=f"{name}-{'upright' if upright else 'lying'}")
    for name in MACHINES
    for upright in (False, True)
]
"""Every machine drawn, lying (the docs) and upright (a phone's status page)."""


@pytest.mark.parametrize(("name", "upright"), DRAWINGS)
class TestEdgesJoinTheirBoxes:
    def test_each_row_is_one_edge_between_its_boxes(self, name: str, upright: bool) -> None:
        """Each (source, trigger) of the table is one path that starts on its source's
        border, ends on its dest's border and enters no box on the way."""
        machine, table = MACHINES[name]
        boxes, drawn, _ = _read(diagrams.svg(machine, upright=upright))
        expected = [
            (source.value, rule.dest.value, rule.trigger)
            for rule in table
            for source in rule.sources
        ]
        assert sorted((d.source, d.dest, d.trigger) for d in drawn) == sorted(expected)
        for edge in drawn:
            where = f"{edge.source} -> {edge.dest} ({edge.trigger})"
            assert boxes[edge.source].borders(edge.points[0]), f"{where} starts off its source"
            assert boxes[edge.dest].borders(edge.points[-1]), f"{where} ends off its dest"
            entered = sorted(
                {state for point in edge.points for state, box in boxes.items() if box.holds(point)}
            )
            assert entered == [], f"{where} runs through {entered}"

    def test_labels_lie_clear_of_other_edges_boxes_and_labels(
        self, name: str, upright: bool
    ) -> None:
        """No label's box, halo included, touches an edge but its own, a state's box or
        another label."""
        machine, _ = MACHINES[name]
        boxes, drawn, edges = _read(diagrams.svg(machine, upright=upright))
        for edge in drawn:
            where = f"label of {edge.source} -> {edge.dest} ({edge.trigger})"
            crossed = [
                path
                for path in edges
                if path != edge.points and any(edge.label.holds(p, 0) for p in path)
            ]
            assert crossed == [], f"{where} lies on {len(crossed)} other edge(s)"
            covered = [state for state, box in boxes.items() if edge.label.meets(box)]
            assert covered == [], f"{where} covers {covered}"
            others = [d.trigger for d in drawn if d is not edge and edge.label.meets(d.label)]
            assert others == [], f"{where} covers the labels of {others}"
