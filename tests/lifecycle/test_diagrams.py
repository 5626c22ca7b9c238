"""Diagrams are drawn from the machine and the committed copies are current."""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET
from pathlib import Path

from attention import Platform
from lifecycle.machines.adapter import AdapterMachine
from lifecycle.machines.component import ComponentLifecycle, LifecycleMachine
from lifecycle.machines.pipeline import PipelineMachine
from lifecycle.machines.tables import (
    ADAPTER_TRANSITIONS,
    PIPELINE_TRANSITIONS,
    TRANSITIONS,
    WORKER_TRANSITIONS,
    ComponentState,
)
from lifecycle.machines.worker import WorkerMachine
from lifecycle.orchestrator import Orchestrator
from lifecycle.pictures import diagrams
from lifecycle.refusals import RefusalCode
from lifecycle.spec.reading import load_spec
from tests.lifecycle.test_machine import passing_checks


class TestDiagrams:
    def test_committed_diagrams_are_current(self, root: Path) -> None:
        """The files under diagrams/ equal what the machine draws now."""
        assert diagrams.stale_diagrams(root / "diagrams") == []

    def test_readme_embeds_the_generated_mermaid(self, root: Path) -> None:
        """The README's lifecycle diagram is the generated Mermaid text, verbatim."""
        readme = (root / "README.md").read_text(encoding="utf-8")
        block = re.search(r"```mermaid\n(.*?)```", readme, re.DOTALL)
        assert block is not None
        assert block.group(1) == diagrams.mermaid()

    def test_readme_embeds_the_generated_refusal_table(self, root: Path) -> None:
        """The README's refusal-code table is the one drawn from RefusalCode, verbatim."""
        readme = (root / "README.md").read_text(encoding="utf-8")
        assert diagrams.refusal_table() in readme

    def test_design_doc_embeds_the_generated_transition_tables(self, root: Path) -> None:
        """docs/design.md carries every machine's transition table as generated, verbatim."""
        design = (root / "docs" / "design.md").read_text(encoding="utf-8")
        fence = r"<!-- transitions:begin -->\n(.*?)<!-- transitions:end -->"
        block = re.search(fence, design, re.DOTALL)
        assert block is not None
        assert block.group(1) == diagrams.transition_tables()

    def test_transition_tables_list_every_rule_once(self) -> None:
        """Each rule of the four tables is one row, with its sources, destination and guards."""
        text = diagrams.transition_tables()
        tables = (TRANSITIONS, PIPELINE_TRANSITIONS, WORKER_TRANSITIONS, ADAPTER_TRANSITIONS)
        rows = [line for line in text.splitlines() if line.startswith("| `")]
        rules = [rule for table in tables for rule in table]
        assert len(rows) == len(rules)
        for row, rule in zip(rows, rules, strict=True):
            cells = [cell.strip() for cell in row.strip("|").split("|")]
            assert cells[0] == f"`{rule.trigger}`"
            assert cells[1] == ", ".join(source.value for source in rule.sources)
            assert cells[2] == rule.dest.value
            assert cells[3] == (", ".join(f"`{g}`" for g in rule.guards) or "-")

    def test_refusal_table_lists_every_code_once(self) -> None:
        """Each RefusalCode has exactly one row, saying whether check can refuse with it."""
        rows = diagrams.refusal_table().splitlines()[2:]
        assert [row.split("`")[1] for row in rows] == [code.value for code in RefusalCode]
        assert all(
            ("| yes |" in row) == code.from_spec
            for row, code in zip(rows, RefusalCode, strict=True)
        )

    def test_every_table_row_is_drawn_with_its_guards(self) -> None:
        """Each (source, trigger) of the table appears once, labelled with its guards."""
        text = diagrams.mermaid()
        for rule in TRANSITIONS:
            for source in rule.sources:
                edges = [
                    line
                    for line in text.splitlines()
                    if line.strip().startswith(
                        f"{source.value} --> {rule.dest.value} : {rule.trigger}"
                    )
                ]
                assert len(edges) == 1
                for guard in rule.guards:
                    assert guard in edges[0]

    def test_every_pipeline_row_is_drawn_with_its_guards(self) -> None:
        """The pipeline diagram draws each (source, trigger) of its own table once, with
        its guards, from its initial state."""
        text = diagrams.mermaid(PipelineMachine("pipelines"))
        assert "    [*] --> serving" in text.splitlines()
        for rule in PIPELINE_TRANSITIONS:
            for source in rule.sources:
                edges = [
                    line
                    for line in text.splitlines()
                    if line.strip().startswith(
                        f"{source.value} --> {rule.dest.value} : {rule.trigger}"
                    )
                ]
                assert len(edges) == 1
                for guard in rule.guards:
                    assert guard in edges[0]

    def test_the_worker_diagram_is_its_table(self) -> None:
        """The worker's own diagram draws each (source, trigger) of WORKER_TRANSITIONS once,
        from starting; draining ends it."""
        text = diagrams.mermaid(WorkerMachine("worker")).splitlines()
        assert "    [*] --> starting" in text
        assert "    draining --> [*]" in text
        drawn = [line.strip() for line in text if " : " in line]
        assert drawn == [
            f"{source.value} --> {rule.dest.value} : {rule.trigger}"
            for rule in WORKER_TRANSITIONS
            for source in rule.sources
        ]

    def test_models_do_not_leak_into_the_drawing(self) -> None:
        """A machine with components in odd states draws the same diagram as a bare one."""
        machine = LifecycleMachine()
        component = ComponentLifecycle("vae", checks=passing_checks())
        machine.add_component(component)
        component.release()
        assert component.state is ComponentState.RELEASED
        assert diagrams.mermaid(machine) == diagrams.mermaid()
        assert diagrams.dot(machine) == diagrams.dot()
        assert diagrams.svg(machine) == diagrams.svg()

    def test_adapter_diagram_is_its_table(self) -> None:
        """The adapter drawing has one edge per row and source of ADAPTER_TRANSITIONS."""
        text = diagrams.mermaid(AdapterMachine("adapters"))
        edges = [line for line in text.splitlines() if " : " in line]
        assert len(edges) == sum(len(rule.sources) for rule in ADAPTER_TRANSITIONS)
        assert "    loaded --> active : activate [component_idle & memory_budget]" in edges

    def test_write_then_check(self, tmp_path: Path) -> None:
        """Written diagrams check clean; an edited one is reported stale."""
        written = diagrams.write_diagrams(tmp_path)
        assert {p.name for p in written} == {
            "component_lifecycle.mmd",
            "component_lifecycle.dot",
            "component_lifecycle.svg",
            "pipeline_lifecycle.mmd",
            "pipeline_lifecycle.dot",
            "pipeline_lifecycle.svg",
            "worker_lifecycle.mmd",
            "worker_lifecycle.dot",
            "worker_lifecycle.svg",
            "adapter_lifecycle.mmd",
            "adapter_lifecycle.dot",
            "adapter_lifecycle.svg",
            "refusal_codes.md",
            "transitions.md",
        }
        assert diagrams.stale_diagrams(tmp_path) == []
        (tmp_path / "component_lifecycle.dot").write_text("digraph {}\n")
        assert diagrams.stale_diagrams(tmp_path) == [tmp_path / "component_lifecycle.dot"]


SVG = "{http://www.w3.org/2000/svg}"


class TestSvg:
    def test_every_state_is_one_node(self) -> None:
        """The SVG holds one state node per ComponentState, each with a slot for occupants."""
        root = ET.fromstring(diagrams.svg())
        nodes = [g for g in root.iter(f"{SVG}g") if g.get("class") == "state"]
        assert [g.get("data-state") for g in nodes] == [s.value for s in ComponentState]
        for node in nodes:
            texts = {t.get("class"): t for t in node.iter(f"{SVG}text")}
            assert texts["name"].text == node.get("data-state")
            assert texts["occupants"].text is None

    def test_every_table_row_is_one_arrow_and_every_guard_is_in_the_legend(self) -> None:
        """Each (source, trigger) of the table is one arrow; the legend names its guards."""
        root = ET.fromstring(diagrams.svg())
        arrows = [
            (g.get("data-source"), g.get("data-dest"), g.find(f"{SVG}text").text)
            for g in root.iter(f"{SVG}g")
            if g.get("class") == "transition"
        ]
        expected = [
            (source.value, rule.dest.value, rule.trigger)
            for rule in TRANSITIONS
            for source in rule.sources
        ]
        assert sorted(arrows) == sorted(expected)
        legend = [t.text for t in root.iter(f"{SVG}text") if t.get("class") == "legend"]
        assert [line.split(" ")[0] for line in legend] == [r.trigger for r in TRANSITIONS]
        for line, rule in zip(legend, TRANSITIONS, strict=True):
            assert all(guard in line for guard in rule.guards)

    def test_committed_plan_picture_is_current(self, root: Path) -> None:
        """diagrams/tiny-t2i_plan.svg is the tiny-t2i plan as admitted on the CPU now."""
        spec = load_spec(root / "examples" / "tiny_t2i.toml")
        plan = Orchestrator(spec, platform=Platform("cpu")).admit()
        committed = (root / "diagrams" / diagrams.plan_name(spec)).read_text(encoding="utf-8")
        assert committed == diagrams.plan(spec, plan)

    def test_plan_links_each_stage_to_what_it_uses(self, root: Path) -> None:
        """The plan draws each stage and each component once, with the component's residency."""
        spec = load_spec(root / "examples" / "tiny_t2i.toml")
        plan = Orchestrator(spec, platform=Platform("cpu")).admit()
        root_element = ET.fromstring(diagrams.plan(spec, plan))
        boxes = {
            g.get("data-key"): [t.text for t in g.iter(f"{SVG}text")]
            for g in root_element.iter(f"{SVG}g")
        }
        assert list(boxes) == ["encode", "denoise", "decode", "text_encoder", "transformer", "vae"]
        assert "component_offload -> host" in boxes["text_encoder"]
        assert "resident" in boxes["transformer"]
        edges = [p for p in root_element.iter(f"{SVG}path") if p.get("class") == "edge"]
        assert len(edges) == len(spec.stages) - 1 + sum(len(s.uses) for s in spec.stages)
