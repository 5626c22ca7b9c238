"""Interfaces: do the components of a pipeline fit together, stage after stage?

Each kind declares the ``Batch`` fields it reads and writes with the widths its
options imply (``ComponentLoader.reads`` / ``writes``). A request runs the stages
in order and each stage's components in order, so a reader sees the field as the
last writer before it left it; a field no one wrote yet is made up from a seed by
the reader, which always fits.
"""

from __future__ import annotations

from collections.abc import Mapping

from components.batch import Port
from components.loader import ComponentLoader
from lifecycle.refusals import Refusal, RefusalCode
from lifecycle.spec.structs import PipelineSpec

__all__ = ["interface_refusals"]


def interface_refusals(spec: PipelineSpec, loaders: Mapping[str, ComponentLoader]) -> list[Refusal]:
    """Refuse each reader whose declared width differs from what the last writer left.

    One refusal per (writer, reader, field), however often the stages repeat it.
    ``loaders`` are those of the components with an admitted loading path: one without
    is refused already, and its widths may not be readable (a folder that is missing).
    """
    written: dict[str, tuple[str, Port]] = {}
    found: dict[tuple[str, str, str], Refusal] = {}
    for stage in spec.stages:
        for name in stage.uses:
            loader = loaders.get(name)
            if loader is None:
                continue
            for port in loader.reads():
                writer = written.get(port.field)
                if writer is None or writer[0] == name:
                    continue
                key = (writer[0], name, port.field)
                if key not in found and _differ(writer[1], port):
                    found[key] = _mismatch(writer[0], writer[1], name, port, stage.name)
            for port in loader.writes():
                written[port.field] = (name, port)
    return list(found.values())


def _differ(wrote: Port, reads: Port) -> bool:
    return wrote.width is not None and reads.width is not None and wrote.width != reads.width


def _mismatch(writer: str, wrote: Port, reader: str, reads: Port, stage: str) -> Refusal:
    fixes = [
        f"components.{component}.options.{port.option} = {width}"
        for component, port, width in (
            (reader, reads, wrote.width),
            (writer, wrote, reads.width),
        )
        if port.option is not None
    ]
    return Refusal(
        code=RefusalCode.INTERFACE_MISMATCH,
        component=reader,
        message=f"component '{reader}' (stage '{stage}') reads {reads.field} "
        f"{reads.width} wide, but '{writer}' writes it {wrote.width} wide",
        hint=f"set {' or '.join(fixes)}"
        if fixes
        else f"pick components whose {reads.field} widths agree",
    )
