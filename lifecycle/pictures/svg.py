"""State machines and pipeline plans drawn as SVG, laid out here: byte-stable, no renderer.

The layout is an arc diagram: the states stand in one row, in the order of their
longest distance from the initial state (back edges set aside), so every forward
edge points on along the row. An edge to the next state is a straight arrow; any
other edge leaves its source's side, runs along a track beside the row (before it,
forward; after it, back) and enters its target's side. Edges whose spans overlap
get different tracks, and edges meeting a node side are spread over it so that
nested ones never cross there. A label lies beside its own track in a gap between
two nodes, where no other edge passes: nothing is ever drawn through a third state
or under another edge's label.

Text is monospace, so widths are known without fonts; every coordinate is rounded to
an integer, so the same table draws the same bytes on every machine. The markup is
meant for the status page too: each state is ``<g class="state" data-state="...">``
with an empty ``<text class="occupants">`` that the page fills with its components.
"""

from __future__ import annotations

import textwrap
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from xml.sax.saxutils import escape

__all__ = ["PlanBox", "plan_svg", "state_svg"]

FONT_PX = 12
CHAR_PX = 7.2  # a monospace advance is 0.6 em
NODE_H = 44
COLUMN_GAP = 84
TRACK_PX = 22
LABEL_PX = 20  # a label's extent across its track: a line of text and its halo
CORNER_PX = 8  # the radius where an edge turns from a node's side onto its track
MARGIN = 16
INITIAL_PX = 44  # room left of the initial state for its start dot

Edge = tuple[str, str, str]
"""One transition to draw: (source, dest, label)."""

# every rule scoped to .diagram: an SVG inlined in a page shares the page's style sheet
_STYLE = (
    ".diagram text{font-family:ui-monospace,SFMono-Regular,Menlo,Consolas,monospace;"
    "font-size:12px;fill:#1f2328}"
    ".diagram .state rect{fill:#f6f8fa;stroke:#57606a;stroke-width:1.2}"
    ".diagram .state .occupants{font-size:11px;fill:#0b5cad}"
    ".diagram .edge{fill:none;stroke:#57606a;stroke-width:1.1}"
    ".diagram .label{paint-order:stroke;stroke:#fff;stroke-width:4px;stroke-linejoin:round}"
    ".diagram .legend{font-size:11px;fill:#57606a}"
    ".diagram .start{fill:#1f2328}"
)


@dataclass(frozen=True)
class _Arc:
    source: str
    dest: str
    label: str
    above: bool  # on the side before the nodes across the flow: above, or left when upright
    level: int  # its track, counted out from the nodes


@dataclass(frozen=True)
class _Frame:
    """Where a state diagram's parts go, along the flow (main) and across it (cross).

    Lying (the docs): the flow runs left to right. Upright (a phone's screen): top to
    bottom, tracks to the left (forward) and right (back), labels turned along them.
    """

    upright: bool
    node_w: int  # a node's width on the page, whichever way the flow runs

    def point(self, main: int, cross: int) -> tuple[int, int]:
        return (cross, main) if self.upright else (main, cross)

    @property
    def along(self) -> int:  # a node's extent along the flow
        return NODE_H if self.upright else self.node_w

    @property
    def across(self) -> int:  # and across it
        return self.node_w if self.upright else NODE_H


@dataclass(frozen=True)
class _Layout:
    """Where the nodes of a state diagram stand.

    Attributes:
        frame: which way the flow runs.
        order: the states along the flow.
        main: each state's start along the flow.
        top: where every node starts across the flow (one row).
        gap: the room between two neighbouring nodes, wide enough for any label.
    """

    frame: _Frame
    order: tuple[str, ...]
    main: Mapping[str, int]
    top: int
    gap: int

    def gap_middle(self, index: int) -> int:
        """Return the middle, along the flow, of the gap after the ``index``-th node."""
        return self.main[self.order[index]] + self.frame.along + self.gap // 2

    def track(self, arc: _Arc) -> int:
        """Return where ``arc`` runs across the flow."""
        if arc.above:
            return self.top - arc.level * TRACK_PX
        return self.top + self.frame.across + arc.level * TRACK_PX


def state_svg(
    name: str,
    states: Sequence[str],
    initial: str,
    edges: Sequence[Edge],
    legend: Sequence[str] = (),
    *,
    upright: bool = False,
) -> str:
    """Return a state machine drawn as an SVG document.

    Args:
        name: the diagram's name (its ``id`` and title).
        states: every state, in declaration order (the order among states equally far
            from ``initial``).
        initial: the state the start dot points at.
        edges: every transition, in table order.
        legend: lines written under the drawing (what each trigger is guarded by),
            wrapped to its width.
        upright: draw the flow top to bottom (narrow screens) instead of left to right.
    """
    order = _order(states, initial, edges)
    index = {state: i for i, state in enumerate(order)}
    straight = _straight(edges, index)
    arcs = _levels([e for e in edges if e not in straight], index)
    above = max((a.level for a in arcs if a.above), default=0)
    below = max((a.level for a in arcs if not a.above), default=0)
    frame = _Frame(upright, round(max(len(s) for s in states) * CHAR_PX + 28))
    # a label sits in a gap with room to spare, so that no node side's edge reaches it
    gap = max(40 if upright else COLUMN_GAP, round(max(len(e[2]) for e in edges) * CHAR_PX) + 20)
    start = INITIAL_PX - 8 if upright else INITIAL_PX
    top = MARGIN + above * TRACK_PX + (LABEL_PX if above else 0)
    main = {s: MARGIN + start + index[s] * (frame.along + gap) for s in states}
    layout = _Layout(frame, tuple(order), main, top, gap)
    flow_end = MARGIN + start + len(states) * (frame.along + gap) - gap + MARGIN
    cross_end = top + frame.across + below * TRACK_PX + (LABEL_PX if below else 0) + MARGIN
    width, drawn_to = (cross_end, flow_end) if upright else (flow_end, cross_end)
    columns = max(20, (width - 2 * MARGIN) * 10 // 66)  # legend characters (11 px) a line holds
    lines = [
        wrapped
        for line in legend
        for wrapped in textwrap.wrap(line, columns, subsequent_indent="  ")
    ]
    height = drawn_to + len(lines) * (FONT_PX + 4) + (MARGIN // 2 if lines else 0)
    finals = {s for s in states if not any(src == s for src, _, _ in edges)}

    out = _open(name, width, height)
    ports = _ports(arcs, main, frame.along, index)
    for arc in arcs:
        out.append(_arc(arc, ports, index, layout))
    for source, dest, label in straight:
        out.append(_arrow(source, dest, label, index, layout))
    mid = top + frame.across // 2
    dot = main[initial] - start + 8
    dot_x, dot_y = frame.point(dot, mid)
    out.append(f'<circle class="start" cx="{dot_x}" cy="{dot_y}" r="6"/>')
    out.append(_line(*frame.point(dot + 6, mid), *frame.point(main[initial], mid)))
    for state in states:
        left, node_top = frame.point(main[state], top)
        out.append(_node(state, left, node_top, frame.node_w, state in finals))
    for i, line in enumerate(lines):
        baseline = drawn_to + i * (FONT_PX + 4) + FONT_PX - 4
        out.append(
            f'<text class="legend" x="{MARGIN}" y="{baseline}" xml:space="preserve">'
            f"{escape(line)}</text>"
        )
    out.append("</svg>")
    return "\n".join(out) + "\n"


@dataclass(frozen=True)
class PlanBox:
    """One box of a plan diagram: a title line and the lines under it.

    Attributes:
        key: what edges name it by.
        lines: its text, the first line bold.
    """

    key: str
    lines: tuple[str, ...]


def plan_svg(
    name: str,
    stages: Sequence[PlanBox],
    components: Sequence[PlanBox],
    uses: Mapping[str, Sequence[str]],
) -> str:
    """Return a pipeline's plan drawn as an SVG document.

    Stages stand in a row in timeline order, joined by arrows; their components
    stand in a row under them, each stage linked to the components it uses.

    Args:
        name: the diagram's name (its ``id`` and title).
        stages: the stages, in timeline order.
        components: the components, in the order to draw them.
        uses: stage key -> the component keys it uses.
    """
    stage_w = comp_w = max(_box_width(stages), _box_width(components))  # rows line up
    stage_h = _box_height(stages)
    comp_h = _box_height(components)
    gap = 40
    row_w = max(len(stages) * (stage_w + gap), len(components) * (comp_w + gap)) - gap
    width = row_w + 2 * MARGIN
    stage_x = _centred(len(stages), stage_w, gap, row_w)
    comp_x = _centred(len(components), comp_w, gap, row_w)
    comp_top = MARGIN + stage_h + 70
    height = comp_top + comp_h + MARGIN
    where = {box.key: i for i, box in enumerate(components)}
    out = _open(name, width, height)
    for i, stage in enumerate(stages):
        used = [where[c] for c in uses.get(stage.key, ()) if c in where]
        for k, j in enumerate(used):
            start = stage_x[i] + round(stage_w * (k + 1) / (len(used) + 1))
            end = comp_x[j] + comp_w // 2
            out.append(_line(start, MARGIN + stage_h, end, comp_top))
        if i:
            mid = MARGIN + stage_h // 2
            out.append(_line(stage_x[i - 1] + stage_w, mid, stage_x[i], mid))
    for i, box in enumerate(stages):
        out.append(_box(box, "stage", stage_x[i], MARGIN, stage_w, stage_h))
    for i, box in enumerate(components):
        out.append(_box(box, "component", comp_x[i], comp_top, comp_w, comp_h))
    out.append("</svg>")
    return "\n".join(out) + "\n"


# -- layout -----------------------------------------------------------------------


def _order(states: Sequence[str], initial: str, edges: Sequence[Edge]) -> list[str]:
    """Return the states along the flow: by distance from ``initial``, then as declared."""
    column = _columns(states, initial, edges)
    return sorted(states, key=lambda s: (column[s], s != initial, states.index(s)))


def _columns(states: Sequence[str], initial: str, edges: Sequence[Edge]) -> dict[str, int]:
    """Return each state's longest path from ``initial``, back edges set aside."""
    successors: dict[str, list[str]] = {s: [] for s in states}
    for source, dest, _ in edges:
        if dest not in successors[source]:
            successors[source].append(dest)
    back: set[tuple[str, str]] = set()
    on_path: list[str] = []
    seen: set[str] = set()

    def visit(state: str) -> None:  # depth first, in table order
        seen.add(state)
        on_path.append(state)
        for nxt in successors[state]:
            if nxt in on_path:
                back.add((state, nxt))
            elif nxt not in seen:
                visit(nxt)
        on_path.pop()

    for state in (initial, *states):
        if state not in seen:
            visit(state)
    column = dict.fromkeys(states, 0)
    for _ in states:  # longest path: relax as often as there are states
        for source in states:
            for dest in successors[source]:
                if (source, dest) not in back and column[dest] < column[source] + 1:
                    column[dest] = column[source] + 1
    return column


def _straight(edges: Sequence[Edge], index: Mapping[str, int]) -> list[Edge]:
    """Return the edges drawn as straight arrows: the first from each node to the next."""
    straight: dict[str, Edge] = {}
    for edge in edges:
        if index[edge[1]] - index[edge[0]] == 1:
            straight.setdefault(edge[0], edge)
    return list(straight.values())


def _levels(edges: Sequence[Edge], index: Mapping[str, int]) -> list[_Arc]:
    """Give every arc the track nearest the nodes on which it overlaps no other arc."""
    taken: dict[tuple[bool, int], list[tuple[int, int]]] = {}
    arcs = []
    for source, dest, label in sorted(edges, key=lambda e: abs(index[e[1]] - index[e[0]])):
        above = index[dest] > index[source]  # forward before the row, back after it
        span = sorted((index[source], index[dest]))
        level = 1
        while any(a < span[1] and span[0] < b for a, b in taken.get((above, level), [])):
            level += 1
        taken.setdefault((above, level), []).append((span[0], span[1]))
        arcs.append(_Arc(source, dest, label, above, level))
    return sorted(arcs, key=lambda a: edges.index((a.source, a.dest, a.label)))


def _ports(
    arcs: Sequence[_Arc], main: Mapping[str, int], along: int, index: Mapping[str, int]
) -> dict[tuple[_Arc, str], int]:
    """Spread the arcs meeting each node side along it: nested arcs keep nested ends."""
    sides: dict[tuple[str, bool], list[tuple[tuple[int, int], _Arc, str]]] = {}
    for arc in arcs:
        for end, other in ((arc.source, arc.dest), (arc.dest, arc.source)):
            goes_back = index[other] < index[end]
            # toward the start: outer arcs further on; toward the end: further back
            key = (0, arc.level) if goes_back else (1, -arc.level)
            sides.setdefault((end, arc.above), []).append((key, arc, end))
    ports: dict[tuple[_Arc, str], int] = {}
    for (state, _), found in sides.items():
        found.sort(key=lambda item: item[0])
        for i, (_, arc, end) in enumerate(found):
            ports[arc, end] = main[state] + round(along * (0.2 + 0.6 * (i + 0.5) / len(found)))
    return ports


def _box_width(boxes: Sequence[PlanBox]) -> int:
    return round(max((len(line) for b in boxes for line in b.lines), default=8) * CHAR_PX + 24)


def _box_height(boxes: Sequence[PlanBox]) -> int:
    return max((len(b.lines) for b in boxes), default=1) * (FONT_PX + 5) + 14


def _centred(count: int, box_w: int, gap: int, row_w: int) -> list[int]:
    used = count * (box_w + gap) - gap
    left = MARGIN + (row_w - used) // 2
    return [left + i * (box_w + gap) for i in range(count)]


# -- markup -------------------------------------------------------------------------


def _open(name: str, width: int, height: int) -> list[str]:
    return [
        f'<svg xmlns="http://www.w3.org/2000/svg" class="diagram" id="{escape(name)}" '
        f'viewBox="0 0 {width} {height}" width="{width}" height="{height}" role="img">',
        f"<title>{escape(name)}</title>",
        f"<style>{_STYLE}</style>",
        "<defs>"
        '<marker id="lc-arrow" viewBox="0 0 10 10" refX="10" refY="5" markerWidth="7" '
        'markerHeight="7" orient="auto-start-reverse"><path d="M0,0 L10,5 L0,10 z" '
        'fill="#57606a"/></marker></defs>',
        f'<rect width="{width}" height="{height}" fill="#fff"/>',
    ]


def _line(x1: int, y1: int, x2: int, y2: int) -> str:
    return f'<path class="edge" d="M{x1},{y1} L{x2},{y2}" marker-end="url(#lc-arrow)"/>'


def _label(label: str, main: int, cross: int, frame: _Frame) -> str:
    """Return a label centred on (main, cross), turned along the flow when upright."""
    x, y = frame.point(main, cross)
    turn = f' transform="rotate(-90 {x} {y})"' if frame.upright else ""
    return (
        f'<text class="label" x="{x}" y="{y}" text-anchor="middle" '
        f'dominant-baseline="central"{turn}>{escape(label)}</text>'
    )


def _arrow(source: str, dest: str, label: str, index: Mapping[str, int], layout: _Layout) -> str:
    """Return the straight arrow from a node to the next, its label beside it in the gap."""
    frame, main = layout.frame, layout.main
    mid = layout.top + frame.across // 2
    start, end = main[source] + frame.along, main[dest]
    return (
        f'<g class="transition" data-source="{source}" data-dest="{dest}">'
        f"{_line(*frame.point(start, mid), *frame.point(end, mid))}"
        f"{_label(label, layout.gap_middle(index[source]), mid - LABEL_PX // 2, frame)}</g>"
    )


def _arc(
    arc: _Arc, ports: Mapping[tuple[_Arc, str], int], index: Mapping[str, int], layout: _Layout
) -> str:
    """Return an edge that leaves its source's side, runs along its track and enters its
    dest's side, turning on rounded corners; its label beside the track, in the middle gap
    of its span."""
    frame = layout.frame
    m1, m2 = ports[arc, arc.source], ports[arc, arc.dest]
    side = layout.top if arc.above else layout.top + frame.across
    track = layout.track(arc)
    out = -1 if arc.above else 1  # away from the nodes, across the flow
    on = 1 if m2 > m1 else -1  # along the flow, from source to dest
    turn = track - out * CORNER_PX
    corners = [
        (m1, side),
        (m1, turn),
        (m1, track),
        (m1 + on * CORNER_PX, track),
        (m2 - on * CORNER_PX, track),
        (m2, track),
        (m2, turn),
        (m2, side),
    ]
    p = [",".join(map(str, frame.point(*c))) for c in corners]
    path = f"M{p[0]} L{p[1]} Q{p[2]} {p[3]} L{p[4]} Q{p[5]} {p[6]} L{p[7]}"
    low, high = sorted((index[arc.source], index[arc.dest]))
    middle = layout.gap_middle(low + (high - low - 1) // 2)
    return (
        f'<g class="transition" data-source="{arc.source}" data-dest="{arc.dest}">'
        f'<path class="edge" d="{path}" marker-end="url(#lc-arrow)"/>'
        f"{_label(arc.label, middle, track + out * LABEL_PX // 2, frame)}</g>"
    )


def _node(state: str, left: int, top: int, node_w: int, final: bool) -> str:
    inner = (
        f'<rect x="{left + 3}" y="{top + 3}" width="{node_w - 6}" height="{NODE_H - 6}" '
        'rx="6" fill="none"/>'
        if final
        else ""
    )
    centre = left + node_w // 2
    return (
        f'<g class="state" data-state="{escape(state)}"><title>{escape(state)}</title>'
        f'<rect x="{left}" y="{top}" width="{node_w}" height="{NODE_H}" rx="8"/>{inner}'
        f'<text class="name" x="{centre}" y="{top + 18}" text-anchor="middle" '
        f'font-weight="bold">{escape(state)}</text>'
        f'<text class="occupants" x="{centre}" y="{top + 34}" text-anchor="middle"></text></g>'
    )


def _box(box: PlanBox, kind: str, left: int, top: int, width: int, height: int) -> str:
    lines = [
        f'<text x="{left + 12}" y="{top + 20 + i * (FONT_PX + 5)}"'
        + (' font-weight="bold">' if i == 0 else ">")
        + f"{escape(line)}</text>"
        for i, line in enumerate(box.lines)
    ]
    return (
        f'<g class="state {kind}" data-key="{escape(box.key)}">'
        f'<rect x="{left}" y="{top}" width="{width}" height="{height}" rx="8"/>'
        + "".join(lines)
        + "</g>"
    )
