"""Log rendering: JSON lines for ops, no frame locals, results kept off the log stream."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
import structlog

from attention import Platform
from lifecycle.logs import configure_logging, get_logger
from lifecycle.machines.tables import ComponentState
from lifecycle.orchestrator import Orchestrator
from lifecycle.spec.structs import PipelineSpec
from lifecycle.testing import capture_events, events_named
from tests.lifecycle.conftest import VAE_BYTES, VaePipeline
from tests.lifecycle.test_requests import NEXT_USES
from tests.lifecycle.test_waiting import wait_behind
from tests.processes import Finished, run_python

ROOT = Path(__file__).resolve().parents[2]

# An embedding program: it serves one request and meets one refusal. PRELUDE is what
# the application did about logging before that.
EMBEDDER = """
import sys
{prelude}
import torch
from attention import Platform
from components.batch import Batch
from lifecycle import Orchestrator, TransitionRefused

with Orchestrator.from_file("examples/tiny_t2i.toml", platform=Platform("cpu")) as orch:
    orch.load()
    batch = Batch(generator=torch.Generator().manual_seed(0), steps=1)
    with orch.request("r1") as request:
        for stage in ("encode", "denoise", "decode"):
            request.run(stage, batch)
    try:
        orch.offload("transformer")
    except TransitionRefused:
        pass
"""


def embed(prelude: str) -> Finished:
    """Run the embedding program after ``prelude`` in a new process; return what it wrote."""
    done = run_python(EMBEDDER.format(prelude=prelude), cwd=ROOT)
    assert done.returncode == 0, done.stderr
    return done


class TestConfigureLogging:
    def test_json_lines_carry_the_fields(self) -> None:
        """A JSON event is one line with level, timestamp, context and Enum values."""
        stream = io.StringIO()
        configure_logging("json", "info", stream)
        with structlog.contextvars.bound_contextvars(request_id="r1"):
            structlog.get_logger().info("lifecycle.transition", dest=ComponentState.RESIDENT)
        (line,) = stream.getvalue().splitlines()
        event = json.loads(line)
        assert event["event"] == "lifecycle.transition"
        assert event["dest"] == "resident"
        assert event["request_id"] == "r1"
        assert event["level"] == "info"
        assert event["timestamp"].endswith("Z")

    def test_level_filters(self) -> None:
        """Events below the configured level are dropped."""
        stream = io.StringIO()
        configure_logging("json", "warning", stream)
        structlog.get_logger().info("quiet")
        structlog.get_logger().warning("loud")
        assert [json.loads(line)["event"] for line in stream.getvalue().splitlines()] == ["loud"]

    def test_tracebacks_carry_no_locals(self) -> None:
        """An exception is rendered as data without any frame's local variables."""
        stream = io.StringIO()
        configure_logging("json", "info", stream)
        secret = "hunter2"
        try:
            raise RuntimeError("boom")
        except RuntimeError:
            structlog.get_logger().exception("lifecycle.failed", token_len=len(secret))
        assert "hunter2" not in stream.getvalue()
        event = json.loads(stream.getvalue())
        assert event["exception"][0]["exc_value"] == "boom"

    def test_console_is_readable(self) -> None:
        """The console renderer writes the event name and its fields as text."""
        stream = io.StringIO()
        configure_logging("console", "info", stream)
        structlog.get_logger().info("residency.moved", component="vae")
        assert "residency.moved" in stream.getvalue()
        assert "component=vae" in stream.getvalue()

    def test_unknown_level_is_refused(self) -> None:
        """A level name that logging does not know is a clear error."""
        with pytest.raises(ValueError, match="unknown log level 'loud'"):
            configure_logging("json", "loud")


class TestEmbedded:
    def test_unconfigured_program_prints_nothing_to_stdout(self) -> None:
        """A program that configures no logging gets no event on stdout, and refusals on stderr."""
        done = embed("")
        assert done.stdout == ""
        assert "event=lifecycle.refused component=transformer trigger=offload" in done.stderr
        assert "lifecycle.transition" not in done.stderr  # info is below the default level

    def test_a_program_of_attention_alone_prints_nothing_to_stdout(self) -> None:
        """Importing only ``attention`` routes its events to ``logging`` too, not to stdout."""
        program = (
            "import logging, sys\n"
            "from attention import Attention, AttentionRole, ComponentRequests, Platform\n"
            "from attention import component_attention_scope\n"
            "requests = ComponentRequests(component='vae')\n"
            "with component_attention_scope(requests, platform=Platform('cpu')):\n"
            "    Attention('self', AttentionRole.SELF)\n"
            "print('quiet')\n"
            "logging.basicConfig(level=logging.INFO, stream=sys.stdout,"
            " format='%(name)s %(message)s')\n"
            "with component_attention_scope(requests, platform=Platform('cpu')):\n"
            "    Attention('self', AttentionRole.SELF)\n"
        )
        done = run_python(program, cwd=ROOT)
        assert done.returncode == 0, done.stderr
        quiet, configured = done.stdout.split("quiet\n")
        assert quiet == ""
        assert "attention event=attention.selected component=vae" in configured
        assert "attention event=attention.summary component=vae" in configured

    def test_events_reach_the_applications_logging_handlers(self) -> None:
        """Where the application configured ``logging``, its handler receives every event."""
        done = embed(
            "import logging\n"
            "logging.basicConfig(level=logging.INFO, stream=sys.stdout,"
            " format='%(name)s|%(levelname)s|%(message)s')"
        )
        records = [line.split("|", 2) for line in done.stdout.splitlines()]
        events = {(name, level, message.split()[0]) for name, level, message in records}
        assert ("lifecycle", "INFO", "event=lifecycle.transition") in events
        assert ("lifecycle", "INFO", "event=residency.moved") in events
        assert ("lifecycle", "INFO", "event=request.end") in events
        assert ("attention", "INFO", "event=attention.summary") in events
        assert ("lifecycle", "WARNING", "event=lifecycle.refused") in events
        assert "request_id=r1" in done.stdout

    def test_the_applications_level_filters(self) -> None:
        """Events below the level the application set never reach its handlers."""
        done = embed(
            "import logging\n"
            "logging.basicConfig(level=logging.WARNING, stream=sys.stdout, format='%(message)s')"
        )
        assert [line.split()[0] for line in done.stdout.splitlines()] == ["event=lifecycle.refused"]


class TestCachedLoggers:
    def test_capture_sees_loggers_cached_at_a_higher_level(self) -> None:
        """capture_events collects info events from a logger first used under level error."""
        stream = io.StringIO()
        configure_logging("json", "error", stream)
        log = get_logger("lifecycle")
        log.info("quiet.before")  # assembles and caches the logger at level error
        assert not log.is_enabled_for(20)
        with capture_events() as events:
            log.info("lifecycle.transition", component="vae")
        assert [e["component"] for e in events_named(events, "lifecycle.transition")] == ["vae"]
        log.info("quiet.after")
        assert stream.getvalue() == ""

    def test_reconfiguring_reaches_cached_loggers(self) -> None:
        """A logger cached under one configure_logging writes to the stream of the next."""
        first, second = io.StringIO(), io.StringIO()
        configure_logging("json", "info", first)
        log = get_logger("lifecycle")
        log.info("lifecycle.first")
        configure_logging("json", "info", second)
        log.info("lifecycle.second")
        assert json.loads(first.getvalue())["event"] == "lifecycle.first"
        assert json.loads(second.getvalue())["event"] == "lifecycle.second"


def run_with_a_wait(cpu: Platform, spec: PipelineSpec) -> None:
    """Run two requests on a fresh orchestrator, the second waiting for the first's memory."""
    with Orchestrator(spec, platform=cpu) as orch:
        orch.load()
        errors, _ = wait_behind(orch)
        assert errors == []


def written(stream: io.StringIO) -> list[tuple[str, str, str]]:
    """Return each event a JSON stream holds: its name, component and request, sorted."""
    events = [json.loads(line) for line in stream.getvalue().splitlines()]
    return sorted((e["event"], str(e.get("component")), str(e.get("request_id"))) for e in events)


class TestReconfiguring:
    def test_a_closed_stream_is_left_behind(self, cpu: Platform, vae_pipeline: VaePipeline) -> None:
        """After configuring onto B and closing A, a whole run writes every event to B."""
        spec = vae_pipeline(VAE_BYTES + 1000, NEXT_USES, wait_timeout=60.0)
        first, second = io.StringIO(), io.StringIO()
        configure_logging("json", "info", first)
        run_with_a_wait(cpu, spec)
        before = written(first)
        first.close()
        configure_logging("json", "info", second)
        run_with_a_wait(cpu, spec)  # raises, or its threads hang, if anything writes to A
        assert ("residency.waited", "None", "r2") in before
        assert written(second) == before

    def test_importing_keeps_the_applications_configuration(self) -> None:
        """An application that configured structlog first keeps its configuration on import."""
        program = (
            "import structlog\n"
            "structlog.configure(processors=[structlog.processors.KeyValueRenderer()],"
            " cache_logger_on_first_use=True)\n"
            "before = structlog.get_config()\n"
            "import attention, components, lifecycle, lifecycle.cli, lifecycle.serving.server\n"
            "after = structlog.get_config()\n"
            "print(sorted(key for key in before if after[key] is not before[key]))\n"
        )
        done = run_python(program, cwd=ROOT)
        assert done.returncode == 0, done.stderr
        assert done.stdout == "[]\n"
