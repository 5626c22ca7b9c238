"""acceleration = "auto": what the spec left open is measured and chosen; explicit keys stay."""

from __future__ import annotations

import json
from pathlib import Path

from attention import Platform
from lifecycle.autotune import tune
from lifecycle.spec.reading import decode_spec
from lifecycle.testing import capture_events, events_named
from tests.conftest import Lifecycle
from tests.lifecycle.test_acceleration_admission import DIT
from tests.lifecycle.test_quantization import needs_torchao

pytestmark = needs_torchao  # torchao itself is imported when a test quantizes


def spec_text(keys: str, pipeline: str = "") -> str:
    """Return the one-DiT spec with ``acceleration = "auto"`` (and ``pipeline`` keys) and
    ``keys`` on its DiT."""
    return DIT.format(keys=keys).replace(
        'device = "cpu"', f'device = "cpu"\nacceleration = "auto"\n{pipeline}'
    )


class TestTune:
    def test_explicit_compile_stays_and_open_quantization_is_autotuned(self, cpu: Platform) -> None:
        """With compile = "off" written and quantization left open, only quantization is
        measured (off and int8_dynamic, never blocks): the tuned spec keeps compile off and
        carries the fastest quantization, logged as acceleration.selected, autotuned."""
        spec = decode_spec(spec_text('compile = "off"'))
        with capture_events() as events:
            tuned, (selected,) = tune(spec, cpu)
        component = tuned.components["transformer"]
        assert component.compile_mode == "off"
        assert component.quantization_mode == selected.quantization
        assert selected.provenance == "autotuned"
        candidates = {(t.compile, t.quantization) for t in selected.candidates}
        assert candidates == {("off", "off"), ("off", "int8_dynamic")}
        measured = [t for t in selected.candidates if t.quantization == "int8_dynamic"]
        assert measured[0].psnr is not None
        assert measured[0].seconds is not None
        assert selected.ratio > 0
        (event,) = events_named(events, "acceleration.selected")
        assert event["provenance"] == "autotuned"
        assert event["component"] == "transformer"

    def test_a_candidate_below_the_psnr_floor_is_dropped(self, cpu: Platform) -> None:
        """A floor no int8 output reaches leaves quantization off, saying why the candidate
        was dropped."""
        spec = decode_spec(spec_text('compile = "off"', "acceleration_min_psnr = 500.0"))
        tuned, (selected,) = tune(spec, cpu)
        assert tuned.components["transformer"].quantization_mode == "off"
        (dropped,) = [t for t in selected.candidates if t.quantization == "int8_dynamic"]
        assert dropped.refused is not None
        assert "below 500 dB" in dropped.refused

    def test_a_spec_that_sets_everything_is_left_as_it_is(self, cpu: Platform) -> None:
        """Every key written: nothing is tuned, the spec comes back unchanged, and
        acceleration.untuned says why."""
        spec = decode_spec(spec_text('compile = "off"\nquantization = "off"'))
        with capture_events() as events:
            tuned, selected = tune(spec, cpu)
        assert tuned == spec
        assert selected == []
        (event,) = events_named(events, "acceleration.untuned")
        assert "nothing is left to tune" in event["reason"]

    def test_off_tunes_nothing(self, cpu: Platform) -> None:
        """Without acceleration = "auto" the spec is not measured at all."""
        spec = decode_spec(spec_text("").replace('"auto"', '"off"'))
        assert tune(spec, cpu) == (spec, [])


def test_run_tunes_before_its_requests(lifecycle: Lifecycle, tmp_path: Path) -> None:
    """lifecycle run of a spec with acceleration = "auto" tunes it first: the JSON log
    carries acceleration.selected for the open component, and the requests run."""
    spec = tmp_path / "spec.toml"
    spec.write_text(spec_text('compile = "off"'))
    done = lifecycle(
        "--log-level", "info", "--log-format", "json", "run", spec, "--json", "--requests", "1"
    )
    assert done.returncode == 0, done.stderr
    events = [json.loads(line) for line in done.stderr.splitlines() if line.startswith("{")]
    (selected,) = [e for e in events if e["event"] == "acceleration.selected"]
    assert selected["provenance"] == "autotuned"
    assert json.loads(done.stdout)["summary"]["requests"] == 1
