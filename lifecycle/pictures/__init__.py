"""Pictures of the lifecycles and of runs: state diagrams (Mermaid,
DOT, SVG laid out here), gantt charts of moves, PNG images."""

__all__: list[str] = []
