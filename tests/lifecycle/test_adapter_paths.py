"""Adapter files in a spec: read relative to the spec file, listed by ``check``, and a
missing one bad input; ``lifecycle check`` runs in a process of its own, in another
working directory than the spec's."""

from __future__ import annotations

import json
import os
import tomllib
from pathlib import Path

import pytest
import yaml

from benchmarks.make_adapter import DEFAULT_TARGETS, write_lora
from benchmarks.make_adapter import linear_shapes as folder_shapes
from lifecycle.cli.exits import ExitCode
from tests.conftest import PipelineFolders
from tests.lifecycle.test_adapters import linear_shapes
from tests.processes import Finished, run_python

EXAMPLE = Path(__file__).parents[2] / "examples" / "tiny_t2i.toml"
ADAPTER = '\n[adapters.style]\npath = "loras/mlp.safetensors"\nscale = 0.8\nmode = "unmerged"\n'
"""An adapter table whose file lies in ``loras/`` beside the spec."""


def check(cwd: Path, *args: str | Path) -> Finished:
    """Run ``lifecycle check *args`` in a process of its own, in ``cwd``."""
    return run_python("lifecycle", "check", *args, cwd=cwd, module=True)


@pytest.fixture
def folders(tmp_path: Path) -> tuple[Path, Path]:
    """Return a folder for specs, with the tiny DiT's LoRA in ``loras/``, and another to
    run from."""
    specs, elsewhere = tmp_path / "specs", tmp_path / "elsewhere"
    elsewhere.mkdir()
    shapes = linear_shapes("tiny_dit", contains="mlp")
    write_lora(shapes, specs / "loras" / "mlp.safetensors", prefix="transformer")
    return specs, elsewhere


def write_specs(specs: Path) -> list[Path]:
    """Write the reference spec with the adapter as TOML, JSON and YAML, each its own name."""
    text = EXAMPLE.read_text().replace('device = "auto"', 'device = "cpu"') + ADAPTER
    raw = tomllib.loads(text)
    toml = specs / "a.toml"
    toml.write_text(text.replace('name = "tiny-t2i"', 'name = "a"'))
    (specs / "b.json").write_text(json.dumps({**raw, "name": "b"}))
    (specs / "c.yaml").write_text(yaml.safe_dump({**raw, "name": "c"}))
    return [toml, specs / "b.json", specs / "c.yaml"]


class TestAdapterPaths:
    def test_read_relative_to_the_spec_file(self, folders: tuple[Path, Path]) -> None:
        """A relative adapter path in a TOML, JSON or YAML spec is read from the spec's
        folder, whatever the working directory; check lists it, absolute, in its table
        and in --json."""
        specs, elsewhere = folders
        paths = [os.path.relpath(path, elsewhere) for path in write_specs(specs)]
        lora = str((specs / "loras" / "mlp.safetensors").resolve())
        table = check(elsewhere, *paths)
        assert table.returncode == 0, table.stdout + table.stderr
        row = f"  style    transformer  unmerged  0.8    {lora}"
        assert table.stdout.splitlines().count(row) == 3, table.stdout
        listed = check(elsewhere, "--json", *paths)
        assert listed.returncode == 0, listed.stdout + listed.stderr
        report = json.loads(listed.stdout)
        for pipeline in report["pipelines"]:
            assert pipeline["adapters"] == [
                {
                    "name": "style",
                    "component": "transformer",
                    "state": "admitted",
                    "mode": "unmerged",
                    "scale": 0.8,
                    "path": lora,
                    "merged_scale": None,
                    "switches": 0,
                }
            ]

    def test_missing_file_is_bad_input(self, folders: tuple[Path, Path]) -> None:
        """A missing adapter file is exit 2 naming the key and the path it was read as,
        in text and in --json, never a refusal."""
        specs, elsewhere = folders
        spec = specs / "a.toml"
        spec.write_text(
            EXAMPLE.read_text() + ADAPTER.replace("mlp.safetensors", "gone.safetensors")
        )
        missing = (specs / "loras" / "gone.safetensors").resolve()
        message = (
            f"Expected a LoRA safetensors file, got 'loras/gone.safetensors': no file at "
            f"{missing}; a relative path is read from the spec file's folder"
        )
        text = check(elsewhere, spec)
        assert (text.returncode, text.stdout) == (ExitCode.BAD_INPUT, "")
        assert text.stderr == f"lifecycle check: {spec}: {message} - at `$.adapters.style.path`\n"
        as_json = check(elsewhere, "--json", spec)
        assert as_json.returncode == ExitCode.BAD_INPUT
        assert json.loads(as_json.stdout) == {
            "error": {"path": "$.adapters.style.path", "message": message}
        }

    def test_folder_spec_reads_both_relative_to_itself(
        self, folders: tuple[Path, Path], pipeline_folder: PipelineFolders
    ) -> None:
        """A spec naming a pipeline folder reads ``source`` and the adapter's file from its
        own folder: check admits the LoRA of the folder's transformer."""
        specs, elsewhere = folders
        folder = pipeline_folder("pixart")
        shapes = folder_shapes(folder, "transformer", DEFAULT_TARGETS)
        write_lora(shapes, specs / "loras" / "pixart.safetensors", prefix="transformer")
        spec = specs / "pixart.toml"
        spec.write_text(
            f'source = "{os.path.relpath(folder, specs)}"\n\n'
            '[adapters.style]\npath = "loras/pixart.safetensors"\n'
        )
        result = check(elsewhere, "--json", os.path.relpath(spec, elsewhere))
        assert result.returncode == 0, result.stdout + result.stderr
        report = json.loads(result.stdout)
        assert report["source"] == str(folder.resolve())
        assert [(a["component"], a["state"], a["path"]) for a in report["adapters"]] == [
            ("transformer", "admitted", str((specs / "loras" / "pixart.safetensors").resolve()))
        ]
