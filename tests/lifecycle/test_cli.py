"""The ``lifecycle`` command, called in-process through ``cli.main``; one smoke test in a
process of its own (forked from the suite's fork server, ``tests.processes``)."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import ClassVar

import pytest
from torch import nn

from components import registry
from components.loader import ComponentLoader
from lifecycle.cli.cores import torch_threads
from lifecycle.cli.exits import ExitCode
from lifecycle.cli.main import _parser
from lifecycle.cli.run import Ending
from tests.conftest import Lifecycle, decode_png
from tests.lifecycle.kinds_for_tests import BrokenKind
from tests.processes import run_python

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "tiny_t2i.toml"
REFUSED = ROOT / "examples" / "refused"


def write(tmp_path: Path, name: str, text: str) -> Path:
    """Write ``text`` to ``tmp_path/name`` and return the path."""
    path = tmp_path / name
    path.write_text(text)
    return path


class TestCheck:
    def test_good_spec_exits_zero_with_the_plan(self, lifecycle: Lifecycle) -> None:
        """An admissible spec prints its plan on stdout and exits 0."""
        result = lifecycle("check", EXAMPLE)
        assert result.returncode == 0, result.stderr
        lines = result.stdout.splitlines()
        assert lines[0].startswith("pipeline 'tiny-t2i': admitted (3 components, 3 stages")
        transformer = next(line for line in lines if line.strip().startswith("transformer"))
        assert "self=torch_flash (default, platform default fallback)" in transformer
        assert "component_offload (explicit)" in result.stdout
        assert "encode [text_encoder] -> denoise [transformer] -> decode [vae]" in result.stdout
        assert lines[-1] == (
            "  platform default fallback: no backend was named for the site explicitly, and "
            "the first choice (its layer's default, else the platform's) cannot serve what the "
            "site needs, so the next one the platform prefers that can serves it; expected, not "
            "an error (set attention_backend to choose)"
        )

    @pytest.mark.parametrize(
        ("where", "key"),
        [
            ("spec", None),
            ("adapter", "$.adapters.s.path"),
            ("weights", "$.components.vae.options.weights"),
        ],
    )
    def test_a_name_too_long_to_look_up_is_bad_input(
        self, lifecycle: Lifecycle, tmp_path: Path, where: str, key: str | None
    ) -> None:
        """A path with a name longer than the file system allows, as the spec, an adapter
        file or a weights option, is bad input at its key: exit 2, no traceback."""
        long = "x" * 300  # over NAME_MAX (255)
        spec = EXAMPLE.read_text()
        if where == "adapter":
            spec += f'\n[adapters.s]\npath = "{long}.safetensors"\n'
        if where == "weights":
            spec = spec.replace(
                'kind = "tiny_vae"', f'kind = "tiny_vae"\noptions = {{ weights = "{long}" }}'
            )
        path = tmp_path / (f"{long}.toml" if where == "spec" else "spec.toml")
        if where != "spec":
            path.write_text(spec)
        result = lifecycle("check", path)
        assert result.returncode == ExitCode.BAD_INPUT, result.stdout + result.stderr
        assert "File name too long" in result.stderr
        if key is not None:
            assert key in result.stderr

    def test_no_legend_without_a_fallback(self, lifecycle: Lifecycle, tmp_path: Path) -> None:
        """A plan whose every site runs the backend asked for explains no fallback."""
        unpacked = EXAMPLE.read_text().replace(
            "packed_sequences = true", "packed_sequences = false"
        )
        result = lifecycle("check", write(tmp_path, "unpacked.toml", unpacked))
        assert result.returncode == 0, result.stderr
        assert "fallback" not in result.stdout
        assert result.stdout.splitlines()[-1].startswith("  stages: encode [text_encoder]")

    def test_good_spec_as_json(self, lifecycle: Lifecycle) -> None:
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
            "dtype": "float32",
            "bytes": 248588,
            "users": ["tiny-t2i"],
            "cache": None,
            "compile": "off",
            "quantization": "off",
        }
        assert report["stages"] == {
            "encode": ["text_encoder"],
            "denoise": ["transformer"],
            "decode": ["vae"],
        }

    def test_bad_key_is_one_line_and_exit_two(self, lifecycle: Lifecycle, tmp_path: Path) -> None:
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

    def test_bad_key_as_json(self, lifecycle: Lifecycle, tmp_path: Path) -> None:
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

    def test_missing_file(self, lifecycle: Lifecycle, tmp_path: Path) -> None:
        """A missing file is exit 2 with one line naming it, and no key path."""
        result = lifecycle("check", tmp_path / "absent.toml")
        assert result.returncode == 2
        assert result.stderr == (
            f"lifecycle check: {tmp_path / 'absent.toml'}: cannot read the spec: "
            "No such file or directory\n"
        )

    def test_broken_syntax(self, lifecycle: Lifecycle, tmp_path: Path) -> None:
        """A file that is not TOML is exit 2 with one line that does not end in "at `$`"."""
        result = lifecycle("check", write(tmp_path, "broken.toml", "name = [\n"))
        assert result.returncode == 2
        assert "invalid TOML" in result.stderr
        assert result.stderr.count("\n") == 1
        assert not result.stderr.rstrip().endswith("at `$`")

    def test_refused_layout_exits_one_with_the_fix(
        self, lifecycle: Lifecycle, tmp_path: Path
    ) -> None:
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

    @pytest.mark.parametrize("code", ["residency.offload_dir_unusable", "residency.host_memory"])
    def test_what_would_fail_at_load_is_refused(self, lifecycle: Lifecycle, code: str) -> None:
        """An unusable offload folder and weights beyond the host's memory: exit 1, both forms."""
        spec = REFUSED / f"{code.split('.')[1]}.toml"
        plain = lifecycle("check", spec)
        assert plain.returncode == 1
        assert plain.stdout.splitlines()[1].split()[:2] == ["(pipeline)", code]
        assert "fix: " in plain.stdout
        checked = lifecycle("check", "--json", spec)
        assert checked.returncode == 1
        report = json.loads(checked.stdout)
        assert report["admitted"] is False
        assert [r["code"] for r in report["refusals"]] == [code]

    def test_pipeline_refusal_shows_pipeline_column(self, lifecycle: Lifecycle) -> None:
        """A refusal about the whole pipeline shows ``(pipeline)`` in the component column."""
        result = lifecycle("check", REFUSED / "invalid_layout.toml")
        assert result.returncode == 1
        assert "\n  (pipeline)  parallel.invalid_layout  sp_degree is 4" in result.stdout

    def test_refusal_is_shown_once_on_a_console(self, lifecycle: Lifecycle) -> None:
        """At the default level a person sees each refusal once: the text, no log line."""
        result = lifecycle("check", "--log-format", "console", REFUSED / "undeclared_use.toml")
        assert result.returncode == 1
        assert (result.stdout + result.stderr).count("residency.undeclared_use") == 1

    @pytest.mark.parametrize("command", ["check", "run"])
    def test_refusal_is_printed_once_when_stderr_is_captured(
        self, lifecycle: Lifecycle, command: str
    ) -> None:
        """With stderr captured (JSON lines by default) and stdout beside it, as ``2>&1``
        does, each refusal appears once: the text on stdout, no event on stderr."""
        result = lifecycle(command, REFUSED / "undeclared_use.toml")
        assert result.returncode == 1
        assert result.stdout.startswith(f"lifecycle {command}: pipeline 'undeclared-use' refused")
        assert (result.stdout + result.stderr).count("residency.undeclared_use") == 1

    @pytest.mark.parametrize("command", ["check", "run"])
    @pytest.mark.parametrize(
        "options", [("--log-format", "json"), ("--log-level", "info")], ids=["json", "info"]
    )
    def test_refusal_event_still_reaches_logs_asked_for(
        self, lifecycle: Lifecycle, command: str, options: tuple[str, ...]
    ) -> None:
        """JSON logs asked for, or the info level, keep the ``lifecycle.refused`` event on
        stderr; the text stays once, on stdout."""
        result = lifecycle(command, *options, REFUSED / "undeclared_use.toml")
        events = [json.loads(line) for line in result.stderr.splitlines()]
        assert [e["codes"] for e in events if e["event"] == "lifecycle.refused"] == [
            ["residency.undeclared_use"]
        ]
        assert result.stdout.count("residency.undeclared_use") == 1


def pinned_twins(tmp_path: Path) -> tuple[Path, Path]:
    """Write two reference pipelines, 'a' and 'b', each keeping its DiT resident."""
    text = EXAMPLE.read_text().replace(
        'kind = "tiny_dit"', 'kind = "tiny_dit"\nresidency = "resident"'
    )
    a = write(tmp_path, "a.toml", text.replace('name = "tiny-t2i"', 'name = "a"'))
    b = write(tmp_path, "b.toml", text.replace('name = "tiny-t2i"', 'name = "b"'))
    return a, b


class TestCheckSeveral:
    def test_each_pipeline_is_checked_beside_the_others(
        self, lifecycle: Lifecycle, tmp_path: Path
    ) -> None:
        """Under a worker budget two pinned DiTs and a stage cannot fit: each pipeline is
        refused with residency.memory_budget naming it; a larger budget admits both."""
        a, b = pinned_twins(tmp_path)
        small = lifecycle("check", a, b, "--device-budget", "500KiB")
        large = lifecycle("check", a, b, "--device-budget", "1MiB")
        assert small.returncode == 1
        assert "lifecycle check: pipeline 'a' refused" in small.stdout
        assert "stage 'decode' of pipeline 'b' needs" in small.stdout
        assert "than the 500.0 KiB budget it shares with pipeline 'a'\n" in small.stdout
        assert "fix: raise --device-budget to at least" in small.stdout
        assert large.returncode == 0, large.stdout
        assert large.stdout.count("admitted (3 components") == 2

    def test_one_pipeline_under_a_worker_budget_shares_it_with_none(
        self, lifecycle: Lifecycle
    ) -> None:
        """``--device-budget`` on one pipeline refuses it without naming other pipelines."""
        result = lifecycle("check", EXAMPLE, "--device-budget", "200KiB")
        assert result.returncode == 1
        assert "other pipelines" not in result.stdout
        assert (
            "stage 'decode' of pipeline 'tiny-t2i' needs 242.8 KiB on device at once "
            "(vae 242.8 KiB), more than the 200.0 KiB budget\n"
        ) in result.stdout
        assert "fix: raise --device-budget to at least 242.8 KiB" in result.stdout

    def test_a_worker_file_sets_the_budget(self, lifecycle: Lifecycle, tmp_path: Path) -> None:
        """``--worker FILE`` gives the budget; --json prints every pipeline's snapshot."""
        a, b = pinned_twins(tmp_path)
        worker = write(tmp_path, "worker.toml", '[worker]\ndevice_budget = "500KiB"\n')
        result = lifecycle("check", "--json", a, b, "--worker", worker)
        report = json.loads(result.stdout)
        assert result.returncode == 1
        assert (report["admitted"], report["device_budget"]) == (False, 500 * 1024)
        assert [p["pipeline"] for p in report["pipelines"]] == ["a", "b"]
        assert {r["code"] for p in report["pipelines"] for r in p["refusals"]} == {
            "residency.memory_budget"
        }

    def test_a_bad_worker_file_is_bad_input(self, lifecycle: Lifecycle, tmp_path: Path) -> None:
        """An unknown key in the worker file is exit 2, one line naming the key."""
        a, b = pinned_twins(tmp_path)
        worker = write(tmp_path, "worker.toml", '[worker]\ndevice_budjet = "1MiB"\n')
        result = lifecycle("check", a, b, "--worker", worker)
        assert result.returncode == ExitCode.BAD_INPUT
        assert result.stderr == (
            f"lifecycle check: {worker}: Object contains unknown field `device_budjet` "
            "- at `$.worker`\n"
        )

    def test_serve_refuses_two_specs_of_one_name(
        self, lifecycle: Lifecycle, tmp_path: Path
    ) -> None:
        """Two specs naming one pipeline cannot be told apart by model: exit 2, nothing runs."""
        pytest.importorskip("uvicorn")
        result = lifecycle("serve", EXAMPLE, EXAMPLE)
        assert result.returncode == ExitCode.BAD_INPUT
        assert "two specs name the pipeline 'tiny-t2i'" in result.stderr

    def test_a_budget_that_is_no_size_is_bad_input(self, lifecycle: Lifecycle) -> None:
        """``--device-budget`` takes a size; anything else is exit 2 saying what it takes."""
        result = lifecycle("check", EXAMPLE, "--device-budget", "lots")
        assert result.returncode == ExitCode.BAD_INPUT
        assert 'Expected a size like "2GiB"' in result.stderr


class TestOptions:
    def test_logging_options_after_the_subcommand(self, lifecycle: Lifecycle) -> None:
        """``--log-level`` and ``--log-format`` work after the subcommand too."""
        result = lifecycle(
            "run", EXAMPLE, "--requests", "1", "--steps", "1", "--log-level", "info",
            "--log-format", "json",
        )  # fmt: skip
        assert result.returncode == 0, result.stderr
        events = {json.loads(line)["event"] for line in result.stderr.splitlines()}
        assert {"request.begin", "request.end"} <= events

    @pytest.mark.parametrize("after", [False, True], ids=["before", "after"])
    @pytest.mark.parametrize(
        ("command", "code"),
        [
            (("check", REFUSED / "undeclared_use.toml"), 1),
            (("run", REFUSED / "unsupported_backend.toml"), 1),
            (("serve", REFUSED / "capability_missing.toml"), 1),
            (("diagram", "--check", "--out", ROOT / "diagrams"), 0),
            (("schema",), 0),
        ],
        ids=lambda value: value[0] if isinstance(value, tuple) else str(value),
    )
    def test_every_subcommand_takes_the_logging_options_on_either_side(
        self, lifecycle: Lifecycle, command: tuple[str | Path, ...], code: int, after: bool
    ) -> None:
        """Each subcommand takes the logging options before or after it, and they apply."""
        options = ("--log-format", "json", "--log-level", "error")
        result = lifecycle(*command, *options) if after else lifecycle(*options, *command)
        assert result.returncode == code, result.stderr
        # at the default level (warning) the refusal event would be logged
        assert "lifecycle.refused" not in result.stderr
        assert "Traceback" not in result.stderr

    def test_logging_options_before_the_subcommand(self, lifecycle: Lifecycle) -> None:
        """Options before the subcommand still apply when none follow it."""
        result = lifecycle("--log-level", "INFO", "--log-format", "json", "check", EXAMPLE)
        assert result.returncode == 0
        assert all(json.loads(line) for line in result.stderr.splitlines())

    def test_version(self, lifecycle: Lifecycle) -> None:
        """``--version`` prints the package version and exits 0."""
        result = lifecycle("--version")
        assert (result.returncode, result.stdout) == (0, "lifecycle 0.1.0\n")

    def test_help_shows_defaults_and_exit_codes(self, lifecycle: Lifecycle) -> None:
        """``run --help`` shows each default and what every exit code means."""
        result = lifecycle("run", "--help")
        assert result.returncode == 0
        text = " ".join(result.stdout.split())
        assert "requests to run (default: 4)" in text
        assert "denoising steps per request (default: a folder's pipeline class's, else 4)" in text
        assert "(default: warning)" in text
        assert "3 failed while running" in text
        assert "130, 143 `run` stopped by SIGINT, SIGTERM" in text

    def test_help_shows_every_default(self, lifecycle: Lifecycle) -> None:
        """Every option that has a value by default shows it in its command's ``--help``."""
        parser = _parser()
        (commands,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        shown = 0
        for name, command in [("", parser), *commands.choices.items()]:
            result = lifecycle(*[name] * bool(name), "--help")
            text = " ".join(result.stdout.split())
            for action in command._actions:
                default = action.default
                if default in (None, argparse.SUPPRESS, []) or isinstance(default, bool):
                    continue  # no value: a flag, a repeatable option, or none until given
                assert f"(default: {default})" in text, f"{name} {action.option_strings}"
                shown += 1
        assert shown >= 8  # --log-*, run's, diagram's and serve's
        serve = " ".join(lifecycle("serve", "--help").stdout.split())
        assert "address to listen on (default: 127.0.0.1)" in serve
        assert (
            "port to listen on; 0: a free one the system picks, named in the ready line "
            "(default: 8000)"
        ) in serve

    @pytest.mark.parametrize(
        "args",
        [
            ("--log-level", "foo", "check", str(EXAMPLE)),
            ("check", str(EXAMPLE), "--log-format", "xml"),
            ("run", str(EXAMPLE), "--requests", "many"),
            ("run", str(EXAMPLE), "--threads", "0"),
            ("frobnicate",),
        ],
        ids=["log-level", "log-format", "requests", "threads", "command"],
    )
    def test_bad_argument_is_exit_two(self, lifecycle: Lifecycle, args: tuple[str, ...]) -> None:
        """A bad argument is a usage line and exit 2, never a traceback."""
        result = lifecycle(*args)
        assert result.returncode == 2
        assert "error: argument" in result.stderr or "invalid choice" in result.stderr
        assert "Traceback" not in result.stderr


class _NoRunKind(ComponentLoader):
    """A kind that builds a module but does not say how it runs in a request."""

    kind: ClassVar[str] = "test_no_run"

    def build_custom(self) -> nn.Module:
        """Build one linear layer."""
        return nn.Linear(4, 4)


class TestRunCommand:
    def test_runs_requests_and_reports(self, lifecycle: Lifecycle, tmp_path: Path) -> None:
        """``run`` serves N requests, prints the human summary only, writes the timeline."""
        timeline = tmp_path / "out" / "timeline.mmd"
        result = lifecycle(
            "run", EXAMPLE, "--requests", "2", "--steps", "2", "--threads", "1",
            "--timeline", timeline,
        )  # fmt: skip
        assert result.returncode == 0, result.stderr
        assert result.stdout.startswith(
            "pipeline 'tiny-t2i': 2 requests x 2 steps on 1 thread (--threads), median "
        )
        assert "{" not in result.stdout
        encoder = next(line for line in result.stdout.splitlines() if "text_encoder" in line)
        # state, size, onloads, offloads (+ load)
        assert encoder.split()[1:6] == ["offloaded", "135.0", "KiB", "2", "3"]
        chart = timeline.read_text()
        assert chart.startswith("gantt\n")
        assert chart.count("resident (r") == 4  # encoder and VAE, one interval per request

    def test_json_is_one_object(self, lifecycle: Lifecycle) -> None:
        """``run --json`` prints one JSON object: summary (with the default thread count and
        why), per-request times, snapshot."""
        result = lifecycle("run", EXAMPLE, "--requests", "2", "--steps", "1", "--json")
        assert result.returncode == 0, result.stderr
        report = json.loads(result.stdout)
        assert set(report) == {"summary", "snapshot"}
        summary = report["summary"]
        assert (summary["pipeline"], summary["requests"], len(summary["request_ms"])) == (
            "tiny-t2i",
            2,
            2,
        )
        assert summary["components"]["vae"]["onloads"] == 2
        default = torch_threads(None)
        assert (summary["threads"], summary["threads_reason"]) == (default.count, default.reason)
        assert report["snapshot"]["components"]["vae"]["state"] == "offloaded"

    def test_json_logs_go_to_stderr(self, lifecycle: Lifecycle) -> None:
        """With ``--json-logs`` every stderr line is a JSON event; stdout stays the result."""
        result = lifecycle("run", EXAMPLE, "--requests", "1", "--steps", "1", "--json-logs")
        assert result.returncode == 0
        events = [json.loads(line)["event"] for line in result.stderr.splitlines()]
        assert {"request.begin", "request.end", "residency.moved", "attention.selected"} <= set(
            events
        )
        assert "lifecycle.transition" in events

    def test_refused_spec_exits_one(self, lifecycle: Lifecycle) -> None:
        """A spec admission refuses is exit 1 with every reason on stdout, as ``check``."""
        result = lifecycle("run", REFUSED / "unsupported_backend.toml", "--log-format", "console")
        assert result.returncode == 1
        assert result.stdout.startswith(
            "lifecycle run: pipeline 'unsupported-backend' refused (1 reason)\n"
        )
        assert "attention.unsupported_backend" in result.stdout
        assert result.stderr == ""

    def test_kind_without_run_is_named(self, lifecycle: Lifecycle, tmp_path: Path) -> None:
        """A staged kind that cannot run a request is named, exit 2, before anything loads."""
        registry.register_kind(_NoRunKind)
        try:
            spec = write(
                tmp_path,
                "k.toml",
                'name="k"\n[components.a]\nkind="test_no_run"\n[[stages]]\nname="s"\nuses=["a"]\n',
            )
            result = lifecycle("run", spec)
        finally:
            registry.unregister_kind("test_no_run")
        assert result.returncode == 2
        assert result.stderr == (
            f"lifecycle run: {spec}: component 'a' of kind 'test_no_run' does not say how it "
            "runs in a request; implement ComponentLoader.run for that kind to drive it with "
            "`lifecycle run`\n"
        )

    @pytest.mark.parametrize("option", ["--timeline", "--out"])
    def test_impossible_output_path_is_refused_first(
        self, lifecycle: Lifecycle, tmp_path: Path, option: str
    ) -> None:
        """An output path that cannot be written is exit 2 before any request runs."""
        blocker = write(tmp_path, "file", "")
        result = lifecycle("run", EXAMPLE, option, blocker / "sub" / "x", "--json-logs")
        assert result.returncode == 2
        assert "Not a directory" in result.stderr
        assert "request.begin" not in result.stderr
        assert "Traceback" not in result.stderr

    def test_failure_while_running_is_exit_three(
        self, lifecycle: Lifecycle, tmp_path: Path
    ) -> None:
        """A transition that fails at run time (a build that raises an I/O error) is exit 3."""
        registry.register_kind(BrokenKind)
        try:
            spec = write(tmp_path, "broken.toml", 'name="b"\n[components.a]\nkind="test_broken"\n')
            result = lifecycle("run", spec, "--requests", "1", "--json")
        finally:
            registry.unregister_kind(BrokenKind.kind)
        assert result.returncode == 3
        assert "load of 'a' failed and was rolled back" in result.stderr
        assert "OSError: weights file truncated" in json.loads(result.stdout)["error"]["message"]
        assert "Traceback" not in result.stderr

    def test_out_writes_pngs_of_the_declared_size(
        self, lifecycle: Lifecycle, tmp_path: Path
    ) -> None:
        """``--out`` writes each request's image as a PNG of the VAE's size (4x the latents)."""
        result = lifecycle(
            "run", EXAMPLE, "--requests", "2", "--steps", "1", "--out", tmp_path / "png"
        )
        assert result.returncode == 0, result.stderr
        files = sorted((tmp_path / "png").iterdir())
        assert [f.name for f in files] == ["r1-0.png", "r2-0.png"]
        assert [tuple(decode_png(f.read_bytes()).shape) for f in files] == [(16, 16, 3)] * 2
        assert f"2 PNG files written to {tmp_path / 'png'}" in result.stdout

    def test_minilm_shows_neighbours_of_given_prompts(self, lifecycle: Lifecycle) -> None:
        """The MiniLM example shows each prompt's nearest neighbour with its cosine."""
        pytest.importorskip("tokenizers")
        result = lifecycle(
            "run", ROOT / "examples" / "minilm_embed.toml", "--requests", "1", "--json",
            "--prompt", "A cat sleeps on the sofa.",
            "--prompt", "A kitten naps on the couch.",
            "--prompt", "The stock market fell sharply today.",
        )  # fmt: skip
        if result.returncode == 1 and "loader.unavailable" in result.stderr:
            pytest.skip("the MiniLM weights package is not installed")
        assert result.returncode == 0, result.stderr
        neighbours = {
            n["sentence"]: (n["neighbour"], n["cosine"])
            for n in json.loads(result.stdout)["summary"]["neighbours"]
        }
        cat, cosine = neighbours["A kitten naps on the couch."]
        assert cat == "A cat sleeps on the sofa."
        assert 0.5 < cosine <= 1.0
        assert neighbours["A cat sleeps on the sofa."][0] == "A kitten naps on the couch."


class TestEnding:
    def test_the_first_thing_that_went_wrong_sets_the_code(self) -> None:
        """A failure after a refusal keeps exit 1; failures add up in order, exit 3."""
        refused = Ending(code=ExitCode.REFUSED).failed("closing the pipeline failed: x")
        assert (refused.code, refused.failures) == (
            ExitCode.REFUSED,
            ("closing the pipeline failed: x",),
        )
        failed = Ending().failed("a").failed("b")
        assert (failed.code, failed.failures) == (ExitCode.FAILED, ("a", "b"))
        assert Ending().code is ExitCode.OK


class TestDiagramCommand:
    def test_check_passes_on_the_committed_diagrams(
        self, lifecycle: Lifecycle, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """``diagram --check`` exits 0 on the repository's diagrams and plan picture."""
        monkeypatch.chdir(ROOT)
        assert lifecycle("diagram", "--check", "--spec", EXAMPLE).returncode == 0

    def test_format_svg_writes_the_pictures_only(
        self, lifecycle: Lifecycle, tmp_path: Path
    ) -> None:
        """``--format svg --spec`` writes the lifecycles and the plan as SVG, nothing else."""
        result = lifecycle("diagram", "--format", "svg", "--spec", EXAMPLE, "--out", tmp_path)
        assert result.returncode == 0
        assert sorted(p.name for p in tmp_path.iterdir()) == [
            "adapter_lifecycle.svg",
            "component_lifecycle.svg",
            "pipeline_lifecycle.svg",
            "tiny-t2i_plan.svg",
            "worker_lifecycle.svg",
        ]

    def test_a_plan_in_another_format_is_bad_input(
        self, lifecycle: Lifecycle, tmp_path: Path
    ) -> None:
        """A plan is drawn only as SVG: ``--format dot --spec`` is exit 2 naming the fix."""
        result = lifecycle("diagram", "--format", "dot", "--spec", EXAMPLE, "--out", tmp_path)
        assert result.returncode == 2
        assert "give --format svg (or all) with --spec" in result.stderr
        assert not tmp_path.exists() or not any(tmp_path.iterdir())

    def test_a_refused_spec_draws_no_plan(self, lifecycle: Lifecycle, tmp_path: Path) -> None:
        """A spec that admission refuses is exit 1 with every reason, and nothing is written."""
        spec = REFUSED / "backend_not_consumed.toml"
        result = lifecycle("diagram", "--spec", spec, "--out", tmp_path / "d")
        assert result.returncode == 1
        assert "attention.backend_not_consumed" in result.stderr
        assert not (tmp_path / "d").exists()

    def test_check_fails_on_a_stale_file(self, lifecycle: Lifecycle, tmp_path: Path) -> None:
        """``diagram --check`` exits 1 and names the file when one is stale."""
        assert lifecycle("diagram", "--out", tmp_path).returncode == 0
        (tmp_path / "component_lifecycle.mmd").write_text("stateDiagram-v2\n")
        result = lifecycle("diagram", "--check", "--out", tmp_path)
        assert result.returncode == 1
        assert "component_lifecycle.mmd is stale" in result.stderr

    def test_check_outside_a_checkout_says_missing(
        self, lifecycle: Lifecycle, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """Outside a checkout the diagrams are reported missing, not stale."""
        monkeypatch.chdir(tmp_path)
        result = lifecycle("diagram", "--check")
        assert result.returncode == 1
        assert "diagrams/component_lifecycle.mmd is missing" in result.stderr
        assert "stale" not in result.stderr

    def test_out_into_an_impossible_path(self, lifecycle: Lifecycle, tmp_path: Path) -> None:
        """``diagram --out`` under a file is exit 2 with one line, no traceback."""
        blocker = write(tmp_path, "file", "")
        result = lifecycle("diagram", "--out", blocker / "d")
        assert result.returncode == 2
        assert result.stderr == (
            f"lifecycle diagram: cannot create the diagram folder {blocker / 'd'}: "
            "Not a directory\n"
        )


class TestSchemaCommand:
    def test_schema_is_json(self, lifecycle: Lifecycle) -> None:
        """``schema`` prints the JSON Schema of the spec."""
        result = lifecycle("schema")
        assert result.returncode == 0
        schema = json.loads(result.stdout)
        assert "PipelineSpec" in schema["$defs"]


class TestSmoke:
    def test_run_json_in_a_process(self) -> None:
        """``python -m lifecycle run --json`` prints one JSON object and no log lines."""
        run = ("run", EXAMPLE, "--requests", "1", "--steps", "1", "--json")
        result = run_python("lifecycle", *run, cwd=ROOT, module=True)
        assert result.returncode == 0, result.stderr
        assert json.loads(result.stdout)["summary"]["requests"] == 1
        assert result.stderr == ""


class TestReaderLeft:
    def test_a_closed_stdout_pipe_is_a_quiet_stop(
        self, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
    ) -> None:
        """``run`` whose stdout's reader left (``| head -1``) exits 141 with no crash line:
        the run did not fail, nobody reads the rest."""
        from lifecycle.cli.entry import READER_LEFT, main

        read, write = os.pipe()
        os.close(read)  # the reader left before a byte was written
        with os.fdopen(write, "w") as closed:
            monkeypatch.setattr(sys, "stdout", closed)
            code = main(["run", str(EXAMPLE), "--requests", "1", "--steps", "1"])
            monkeypatch.undo()
        assert code == READER_LEFT == 141
        assert "failed" not in capsys.readouterr().err
