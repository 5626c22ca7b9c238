"""The ``lifecycle`` command, run for real in a subprocess."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "tiny_t2i.toml"


def lifecycle(*args: str | Path, cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    """Run ``python -m lifecycle`` with ``args`` and capture its output."""
    return subprocess.run(
        [sys.executable, "-m", "lifecycle", *map(str, args)],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def write(tmp_path: Path, name: str, text: str) -> Path:
    """Write ``text`` to ``tmp_path/name`` and return the path."""
    path = tmp_path / name
    path.write_text(text)
    return path


class TestCheck:
    def test_good_spec_exits_zero_with_the_plan(self) -> None:
        """An admissible spec prints its plan on stdout and exits 0."""
        result = lifecycle("check", EXAMPLE)
        assert result.returncode == 0, result.stderr
        lines = result.stdout.splitlines()
        assert lines[0].startswith("pipeline 'tiny-t2i': admitted (3 components, 3 stages")
        transformer = next(line for line in lines if line.strip().startswith("transformer"))
        assert "self=torch_flash (default, platform default fallback)" in transformer
        assert "component_offload (explicit)" in result.stdout
        assert "encode [text_encoder] -> denoise [transformer] -> decode [vae]" in result.stdout

    def test_good_spec_as_json(self) -> None:
        """``--json`` prints the snapshot: every component admitted with its sites."""
        result = lifecycle("check", "--json", EXAMPLE)
        assert result.returncode == 0
        report = json.loads(result.stdout)
        assert report["pipeline"] == "tiny-t2i"
        assert report["admitted"] is True
        assert report["refusals"] == []
        assert report["components"]["vae"] == {
            "kind": "tiny_vae",
            "state": "admitted",
            "loader": "custom",
            "residency": "component_offload",
            "attention": [
                {
                    "site": "mid",
                    "role": "self",
                    "backend": "torch_sdpa",
                    "provenance": "default",
                    "reason": None,
                }
            ],
        }

    def test_bad_key_is_one_line_and_exit_two(self, tmp_path: Path) -> None:
        """A bad value gives exit 2 and one stderr line with the key path, no traceback."""
        spec = write(
            tmp_path, "bad.toml", 'name="x"\n[components.a]\nkind="tiny_vae"\nresidency="offlaod"\n'
        )
        result = lifecycle("check", spec)
        assert result.returncode == 2
        assert result.stdout == ""
        assert result.stderr.count("\n") == 1
        assert "Traceback" not in result.stderr
        assert result.stderr.startswith(f"lifecycle check: {spec}: Expected `resident | ")
        assert "- at `$.components.a.residency`" in result.stderr

    def test_bad_key_as_json(self, tmp_path: Path) -> None:
        """With ``--json`` a bad key is an error object with path and message, exit 2."""
        spec = write(
            tmp_path, "bad.toml", 'name="x"\n[components.a]\nkind="tiny_vae"\nloader="cstom"\n'
        )
        result = lifecycle("check", "--json", spec)
        assert result.returncode == 2
        error = json.loads(result.stdout)["error"]
        assert error == {
            "path": "$.components.a.loader",
            "message": "Expected `custom | native`, got 'cstom'",
        }

    def test_missing_file(self, tmp_path: Path) -> None:
        """A missing file is exit 2 with one line naming it."""
        result = lifecycle("check", tmp_path / "absent.toml")
        assert result.returncode == 2
        assert "No such file or directory" in result.stderr
        assert "Traceback" not in result.stderr

    def test_broken_syntax(self, tmp_path: Path) -> None:
        """A file that is not TOML is exit 2 with one line."""
        result = lifecycle("check", write(tmp_path, "broken.toml", "name = [\n"))
        assert result.returncode == 2
        assert "invalid TOML" in result.stderr
        assert result.stderr.count("\n") == 1

    def test_refused_layout_exits_one_with_the_fix(self, tmp_path: Path) -> None:
        """A layout breaking an invariant is refused (exit 1) with its code and fix."""
        spec = write(
            tmp_path,
            "layout.toml",
            'name="x"\n[parallel]\nsp_degree=2\n[components.a]\nkind="tiny_vae"\n',
        )
        result = lifecycle("check", spec)
        assert result.returncode == 1
        assert "lifecycle check: pipeline 'x' refused (1 reason)" in result.stdout
        assert "parallel.invalid_layout" in result.stdout
        assert "fix: set [parallel] sp_degree" in result.stdout


class TestRunCommand:
    def test_runs_requests_and_reports(self, tmp_path: Path) -> None:
        """``run`` serves N requests, prints the summary and the snapshot, writes the timeline."""
        timeline = tmp_path / "out" / "timeline.mmd"
        result = lifecycle(
            "run", EXAMPLE, "--requests", "2", "--steps", "2", "--timeline", timeline
        )
        assert result.returncode == 0, result.stderr
        summary, _, snapshot = result.stdout.partition("\n{")
        assert summary.startswith("pipeline 'tiny-t2i': 2 requests x 2 steps, median ")
        encoder = next(line for line in summary.splitlines() if "text_encoder" in line)
        assert encoder.split()[1:4] == ["offloaded", "2", "3"]  # onloads, offloads (+ load)
        assert json.loads("{" + snapshot)["components"]["vae"]["state"] == "offloaded"
        chart = timeline.read_text()
        assert chart.startswith("gantt\n")
        assert chart.count("resident (r") == 4  # encoder and VAE, one interval per request

    def test_json_logs_go_to_stderr(self, tmp_path: Path) -> None:
        """With ``--json-logs`` every stderr line is a JSON event; stdout stays the result."""
        result = lifecycle("run", EXAMPLE, "--requests", "1", "--steps", "1", "--json-logs")
        assert result.returncode == 0
        events = [json.loads(line)["event"] for line in result.stderr.splitlines()]
        assert {"request.begin", "request.end", "residency.moved", "attention.selected"} <= set(
            events
        )
        assert "lifecycle.transition" in events

    def test_refused_spec_exits_one(self) -> None:
        """A spec admission refuses is exit 1 with every reason on stderr."""
        result = lifecycle("run", ROOT / "examples" / "refused" / "unsupported_backend.toml")
        assert result.returncode == 1
        assert "attention.unsupported_backend" in result.stderr


class TestDiagramCommand:
    def test_check_passes_on_the_committed_diagrams(self) -> None:
        """``diagram --check`` exits 0 on the repository's diagrams."""
        assert lifecycle("diagram", "--check").returncode == 0

    def test_check_fails_on_a_stale_file(self, tmp_path: Path) -> None:
        """``diagram --check`` exits 1 and names the file when one is stale."""
        assert lifecycle("diagram", "--out", tmp_path).returncode == 0
        (tmp_path / "component_lifecycle.mmd").write_text("stateDiagram-v2\n")
        result = lifecycle("diagram", "--check", "--out", tmp_path)
        assert result.returncode == 1
        assert "component_lifecycle.mmd is stale" in result.stderr


class TestSchemaCommand:
    def test_schema_is_json(self) -> None:
        """``schema`` prints the JSON Schema of the spec."""
        result = lifecycle("schema")
        assert result.returncode == 0
        schema = json.loads(result.stdout)
        assert "PipelineSpec" in schema["$defs"]
