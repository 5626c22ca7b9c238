"""The status page, its event stream and the board behind them (no browser here)."""

from __future__ import annotations

import asyncio
import re
import shutil
import signal
import zipfile
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import msgspec
import pytest
from msgspec import UNSET

from lifecycle.events import Move, Transitioned, TriggerRefused
from lifecycle.machines.tables import ComponentState
from lifecycle.serving.auth import DoorKeys, Secret, page_access
from lifecycle.serving.board import CLIENT_BUFFER, HISTORY, StatusBoard
from lifecycle.spec.structs import PipelineSpec
from tests.lifecycle.conftest import ReferenceSpec
from tests.lifecycle.serving.command import metric, serving
from tests.lifecycle.serving.conftest import WATCHDOG_S, ServeSpec, loopback_client
from tests.lifecycle.serving.streams import (
    RACE_BUDGET,
    EventReader,
    Message,
    event_of,
    evicting_spec,
    is_snapshot,
    moves,
    snapshot_race,
)
from tests.lifecycle.test_waiting import until
from tests.processes import run_python

BUILD_WHEEL = """
import sys

from setuptools import build_meta

build_meta.build_wheel(sys.argv[1])
"""
"""Build the wheel of the sources here into the folder named, with the build backend that
pyproject.toml names (what ``pip wheel --no-build-isolation`` calls, without pip's own
second of start-up)."""

BUDGET = 249_588
"""The VAE (248,588 B) and a little: the text encoder does not fit beside the transformer."""


def move(component: str, direction: str = "onload", request_id: str | None = None) -> Move:
    """Return a move of ``component`` (the figures do not matter here)."""
    return Move(
        component=component,
        direction=direction,  # type: ignore[arg-type]
        target="host",
        bytes=10,
        seconds=0.0,
        request_id=request_id,
        at=0.0,
    )


def refused(may_wait: bool = False) -> TriggerRefused:
    """Return a refusal of the transformer's offload."""
    return TriggerRefused(
        component="transformer",
        trigger="offload",
        source="resident",
        codes=("residency.in_use",),
        messages=("in use",),
        hints=("wait",),
        request_id=None,
        may_wait=may_wait,
    )


def decoded(messages: list[bytes]) -> list[dict[str, object]]:
    """Return the JSON objects of server-sent ``messages``."""
    return [msgspec.json.decode(m.removeprefix(b"data: ")) for m in messages]


class TestStatusBoard:
    def test_a_new_client_gets_recent_moves_and_refusals_then_news(self) -> None:
        """History is moves and final refusals in emitted order; later events follow once."""
        board = StatusBoard()
        observe = board.observer("p")
        transition = Transitioned(
            component="vae",
            trigger="onload",
            source="offloaded",
            dest="resident",
            duration_ms=1.0,
            request_id=None,
        )
        for event in (move("vae"), refused(), refused(may_wait=True), transition, move("te")):
            observe(event)

        async def read() -> tuple[list[bytes], bool, bool, list[bytes]]:
            client = board.subscribe()
            history, stale, ended = await client.next()
            observe(move("dit"))
            news, _, _ = await client.next()
            return history, stale, ended, news

        history, stale, ended, news = asyncio.run(read())
        kinds = [(m["pipeline"], m["event"]["type"]) for m in decoded(history)]  # type: ignore[index]
        assert kinds == [
            ("p", "residency.moved"),
            ("p", "lifecycle.refused"),
            ("p", "residency.moved"),
        ]
        assert (stale, ended) == (True, False)
        assert [m["event"]["component"] for m in decoded(news)] == ["dit"]  # type: ignore[index]

    def test_history_keeps_the_last_moves(self) -> None:
        """A client connecting late gets the last HISTORY moves, not every move."""
        board = StatusBoard()
        observe = board.observer("p")
        for index in range(HISTORY + 5):
            observe(move(f"c{index}"))

        async def read() -> list[bytes]:
            history, _, _ = await board.subscribe().next()
            return history

        history = decoded(asyncio.run(read()))
        assert len(history) == HISTORY
        assert history[0]["event"]["component"] == "c5"  # type: ignore[index]

    def test_a_client_that_falls_behind_is_dropped_not_grown(self) -> None:
        """A client that reads nothing overflows at CLIENT_BUFFER; one that reads gets all."""
        board = StatusBoard()
        observe = board.observer("p")

        async def run() -> tuple[bool, list[bytes], bool, int]:
            slow, fast = board.subscribe(), board.subscribe()
            await fast.next()  # the (empty) history and its first snapshot
            got = 0
            for index in range(CLIENT_BUFFER + 1):
                observe(move(f"c{index}"))
                messages, _, _ = await fast.next()
                got += len(messages)
            kept, _, ended = await slow.next()
            return slow.overflowed, kept, ended, got

        overflowed, kept, ended, got = asyncio.run(run())
        assert overflowed
        assert ended
        assert kept == []  # its buffer was dropped: memory stays bounded
        assert got == CLIENT_BUFFER + 1

    def test_close_ends_every_stream(self) -> None:
        """Closing ends open streams and the streams of clients that come after."""
        board = StatusBoard()

        async def run() -> tuple[bool, bool]:
            before = board.subscribe()
            board.close()
            _, _, first = await before.next()
            _, _, later = await board.subscribe().next()
            return first, later

        assert asyncio.run(run()) == (True, True)
        assert board.subscribers == 0


class TestEventStream:
    def test_stream_opens_with_history_then_the_present(
        self, serve_spec: ServeSpec, t2i_spec: Callable[..., PipelineSpec]
    ) -> None:
        """A new client gets the load's moves, then a snapshot of every component's state."""
        served = serve_spec(t2i_spec())
        reader = EventReader(served.url)
        try:
            snapshot = reader.until(is_snapshot)
        finally:
            reader.close()
        assert reader.status == 200
        before = reader.seen[: reader.seen.index(snapshot)]
        assert [m["event"]["type"] for m in before] == ["residency.moved"] * len(served.moves)
        (pipeline,) = snapshot["pipelines"]
        orchestrator = served.worker.orchestrator
        assert pipeline["phase"] == "ready"
        assert {c["name"]: c["state"] for c in pipeline["components"]} == {
            name: orchestrator.state(name).value for name in orchestrator.spec.components
        }
        assert pipeline["timeline"]  # the load and the warm-up made it resident a while

    def test_snapshot_gives_each_components_compile_quantization_and_bytes(
        self, serve_spec: ServeSpec, reference_spec: ReferenceSpec
    ) -> None:
        """The stream's snapshot says how each component is compiled and quantized, and its
        footprint is the bytes admission counted: an int8 transformer's data and scales."""
        pytest.importorskip("torchao")
        served = serve_spec(reference_spec(transformer={"quantization": "int8_weight_only"}))
        reader = EventReader(served.url)
        try:
            snapshot = reader.until(is_snapshot)
        finally:
            reader.close()
        (pipeline,) = snapshot["pipelines"]
        shown = {c["name"]: c for c in pipeline["components"]}
        planned = served.worker.orchestrator.snapshot().components
        assert {name: (c["compile"], c["quantization"]) for name, c in shown.items()} == {
            "text_encoder": ("off", "off"),
            "transformer": ("off", "int8_weight_only"),
            "vae": ("off", "off"),
        }
        assert {name: c["footprint"] for name, c in shown.items()} == {
            name: planned[name].bytes for name in shown
        }

    def test_a_refused_override_is_streamed_with_its_code_and_fix(
        self, serve_spec: ServeSpec, t2i_spec: Callable[..., PipelineSpec]
    ) -> None:
        """A refused per-request override reaches the stream as lifecycle.refused, with hints."""
        served = serve_spec(t2i_spec())
        reader = EventReader(served.url)
        try:
            reader.until(is_snapshot)
            with served.client() as client:
                answer = client.post(
                    "/v1/images/generations",
                    json={"prompt": "a fox", "attention_backend": "sliding_window"},
                )
            message = reader.until(event_of("lifecycle.refused"))
        finally:
            reader.close()
        assert answer.status_code == 400
        event = message["event"]
        assert event["trigger"] == "request"
        assert event["codes"] == [answer.json()["error"]["code"]]
        assert event["request_id"] == answer.headers["x-request-id"]
        assert "sparse" in event["messages"][0]
        assert event["hints"][0].startswith("name a backend")

    def test_a_client_that_disconnects_is_detached(
        self, serve_spec: ServeSpec, t2i_spec: Callable[..., PipelineSpec]
    ) -> None:
        """While a stream is open /metrics counts it; once the client leaves, it is detached."""
        served = serve_spec(t2i_spec())

        def streams() -> float:
            return metric(served.get("/metrics").text, "lifecycle_event_streams")

        reader = EventReader(served.url)
        reader.until(is_snapshot)
        assert streams() == 1
        reader.close()
        until(lambda: streams() == 0)
        assert served.worker.board.subscribers == 0

    def test_waits_queue_and_running_batches_fill_and_drain(
        self, serve_spec: ServeSpec, t2i_spec: Callable[..., PipelineSpec]
    ) -> None:
        """Requests held up by memory show as running and waiting, the next one as queued;
        once memory is free the snapshots empty again."""
        spec = t2i_spec(memory={"device_budget": BUDGET}, max_batch=1, batch_window_ms=0)
        served = serve_spec(spec)
        orchestrator = served.worker.orchestrator
        reader = EventReader(served.url)

        def generate() -> int:
            with served.client() as client:
                body = {"prompt": "a fox", "steps": 1}
                return client.post("/v1/images/generations", json=body).status_code

        def busy(message: dict[str, object]) -> bool:
            if not is_snapshot(message):
                return False
            (pipeline,) = message["pipelines"]  # type: ignore[misc]
            return len(pipeline["waiting"]) == 2 and len(pipeline["queued"]) == 1

        try:
            reader.until(is_snapshot)
            with ThreadPoolExecutor(3) as pool:
                with orchestrator.request("holder") as holder, holder.stage("denoise"):
                    answers = [pool.submit(generate) for _ in range(3)]
                    full = reader.until(busy)
                assert [a.result(timeout=WATCHDOG_S) for a in answers] == [200] * 3
            idle = reader.until(
                lambda m: (
                    is_snapshot(m)
                    and not any(m["pipelines"][0][k] for k in ("waiting", "queued", "running"))
                )
            )
        finally:
            reader.close()
        (pipeline,) = full["pipelines"]
        assert {w["stage"] for w in pipeline["waiting"]} == {"encode"}
        assert all(w["components"] == ["text_encoder"] for w in pipeline["waiting"])
        assert len(pipeline["running"]) == 2
        assert all(r["step"] == 0 for r in pipeline["running"])  # waiting to encode
        assert {r["id"] for r in pipeline["running"]} == {
            w["request_id"] for w in pipeline["waiting"]
        }
        held = {c["name"]: c["users"] for c in pipeline["components"]}
        assert held["transformer"] == ["holder"]
        assert pipeline["queued"][0]["priority"] == 0  # the default priority
        assert idle["pipelines"][0]["resident_bytes"] <= BUDGET


def bytes_replayed(shown: Message, behind: list[Message], *, skip_shown: bool) -> list[int]:
    """Return the pipeline's bytes on the device after ``shown`` (its status in a snapshot)
    and after each move of ``behind`` applied to it, skipping, if ``skip_shown``, those at
    or below the snapshot's ``seq`` (as the page does)."""
    held = {c["name"]: c["resident_bytes"] for c in shown["components"]}
    seen = [sum(held.values())]
    for message in behind:
        event = message["event"]
        if event["type"] != "residency.moved" or (skip_shown and message["seq"] <= shown["seq"]):
            continue
        held[event["component"]] = event["bytes"] if event["direction"] == "onload" else 0
        seen.append(sum(held.values()))
    return seen


class TestStreamOrder:
    def test_moves_a_snapshot_already_shows_are_told_apart(
        self, serve_spec: ServeSpec, t2i_spec: Callable[..., PipelineSpec]
    ) -> None:
        """Moves that reach a client after a snapshot read past them are at or below its
        seq: skipped, the bytes stay within the budget and end on the next snapshot;
        replayed on it, the text encoder's onload shows beside the VAE, over the budget."""
        served = serve_spec(t2i_spec(memory={"device_budget": RACE_BUDGET}))
        sent = decoded(snapshot_race(served.worker))
        first, racing, last = (i for i, message in enumerate(sent) if is_snapshot(message))
        (shown,) = sent[racing]["pipelines"]  # type: ignore[index]
        behind = sent[racing + 1 : last]
        (final,) = sent[last]["pipelines"]  # type: ignore[index]
        blind = bytes_replayed(shown, behind, skip_shown=False)
        assert {c["name"]: c["state"] for c in shown["components"]} == {
            "text_encoder": "offloaded",
            "transformer": "resident",
            "vae": "resident",
        }
        assert max(blind) > RACE_BUDGET  # the race: an older onload on a newer snapshot
        as_the_page = bytes_replayed(shown, behind, skip_shown=True)
        assert [m["event"]["type"] for m in behind if m["seq"] > shown["seq"]] == [
            "residency.moved",  # the VAE's last offload, news to the snapshot
            "lifecycle.transition",
        ]
        assert max(as_the_page) <= RACE_BUDGET
        assert as_the_page[-1] == final["resident_bytes"]
        seqs = [m["seq"] for m in sent if not is_snapshot(m)]
        assert seqs == sorted(set(seqs))  # one order, every event once
        assert sent[first]["pipelines"][0]["seq"] < shown["seq"] < final["seq"]  # type: ignore[index]


MOVE_FIELDS = ("component", "direction", "target", "bytes", "seconds", "request_id")
"""What a residency.moved log line carries (the typed move adds ``at``)."""


class TestStreamAgainstTheLogs:
    def test_stream_carries_every_logged_move_in_order(self, root: Path, tmp_path: Path) -> None:
        """Over one run of ``lifecycle serve`` (load, concurrent requests that evict, a refusal,
        SIGTERM's drain) the stream carries every residency.moved of the JSON log, in order."""
        spec = evicting_spec(root, tmp_path)
        options = ("--log-format", "json", "--log-level", "info")
        with serving(spec, *options) as (program, url), loopback_client(url) as client:
            reader = EventReader(url)
            reader.until(is_snapshot)

            def generate(body: dict[str, object]) -> int:
                return client.post("/v1/images/generations", json=body).status_code

            bodies = [{"prompt": f"a fox {i}", "steps": 2, "seed": i} for i in range(6)]
            with ThreadPoolExecutor(len(bodies)) as pool:
                assert list(pool.map(generate, bodies)) == [200] * len(bodies)
            assert generate({"prompt": "a fox", "attention_backend": "sliding_window"}) == 400
            program.send_signal(signal.SIGTERM)
            returncode, _, log = program.wait(timeout=WATCHDOG_S)
            assert returncode == 0, log
            assert reader.ended.wait(WATCHDOG_S)  # the drain ended the stream
            reader.close()
        lines = [msgspec.json.decode(line) for line in log.splitlines()]
        logged = [
            {key: line[key] for key in MOVE_FIELDS}
            for line in lines
            if line.get("event") == "residency.moved"
        ]
        streamed = [{key: m[key] for key in MOVE_FIELDS} for m in moves(reader.seen)]
        assert len(logged) > 6 * 4  # each request onloads and offloads, with evictions
        assert streamed == logged


class TestStatusPage:
    def test_page_is_one_self_contained_document(
        self, serve_spec: ServeSpec, t2i_spec: Callable[..., PipelineSpec]
    ) -> None:
        """GET / and /status answer the same page; its policy lets it load nothing else."""
        served = serve_spec(t2i_spec())
        with served.client() as client:
            page, alias = client.get("/"), client.get("/status")
        assert page.status_code == alias.status_code == 200
        assert page.text == alias.text
        assert page.headers["content-type"].startswith("text/html")
        policy = page.headers["content-security-policy"]
        assert "default-src 'none'" in policy
        assert "connect-src 'self'" in policy
        assert "unsafe-inline" not in policy
        body = page.text
        for state in ComponentState:  # drawn lying (wide screens) and upright (phones)
            assert body.count(f'<g class="state" data-state="{state.value}"') == 2
        assert set(re.findall(r"https?://[^\"' )]+", body)) == {"http://www.w3.org/2000/svg"}
        assert not re.search(r"<(link|img|iframe)\b|<script\s+src|@import", body)

    def test_a_locked_worker_keeps_its_page_and_stream_behind_the_key(
        self, serve_spec: ServeSpec, t2i_spec: Callable[..., PipelineSpec]
    ) -> None:
        """With an API key and status_page unset, a stranger gets 401 from the page and
        the stream; the key holder's stream shows another client's request."""
        served = serve_spec(t2i_spec(), DoorKeys(api=Secret("sesame")))
        key = {"authorization": "Bearer sesame"}
        stranger = EventReader(served.url)
        holder = EventReader(served.url, headers=key)
        try:
            holder.until(is_snapshot)
            with served.client() as client:
                pages = [client.get(path).status_code for path in ("/", "/status")]
                answer = client.post(
                    "/v1/images/generations",
                    json={"prompt": "a fox", "steps": 1},
                    headers={**key, "x-request-id": "theirs-1"},
                )
                keyed = client.get("/status", headers=key).status_code
            holder.until(lambda m: m.get("event", {}).get("request_id") == "theirs-1")
        finally:
            stranger.close()
            holder.close()
        assert answer.status_code == 200
        assert (pages, keyed) == ([401, 401], 200)
        assert (stranger.status, holder.status) == (401, 200)
        assert stranger.error["code"] == "invalid_api_key"
        assert stranger.seen == []

    def test_an_explicitly_open_page_is_open_on_a_locked_worker(
        self, serve_spec: ServeSpec, t2i_spec: Callable[..., PipelineSpec]
    ) -> None:
        """status_page = "open" written in the spec opens the page and stream to every
        client, although the /v1 routes need the key."""
        served = serve_spec(t2i_spec(status_page="open"), DoorKeys(api=Secret("sesame")))
        stranger = EventReader(served.url)
        try:
            stranger.until(is_snapshot)
        finally:
            stranger.close()
        with served.client() as client:
            page = client.get("/status").status_code
            models = client.get("/v1/models").status_code
        assert (stranger.status, page, models) == (200, 200, 401)

    def test_private_page_needs_the_api_key(
        self,
        serve_spec: ServeSpec,
        t2i_spec: Callable[..., PipelineSpec],
    ) -> None:
        """status_page = "private": the page and its stream answer 401 without the API key."""
        served = serve_spec(t2i_spec(status_page="private"), DoorKeys(api=Secret("sesame")))
        with served.client() as client:
            assert client.get("/").status_code == 401
            assert (
                client.get("/status", headers={"authorization": "Bearer nope"}).status_code == 401
            )
            assert client.get("/", headers={"authorization": "Bearer sesame"}).status_code == 200
            assert client.get("/healthz").status_code == 200
        refused_reader = EventReader(served.url)
        allowed = EventReader(served.url, headers={"authorization": "Bearer sesame"})
        try:
            allowed.until(is_snapshot)
        finally:
            refused_reader.close()
            allowed.close()
        assert (refused_reader.status, allowed.status) == (401, 200)
        assert refused_reader.error["code"] == "invalid_api_key"

    def test_private_page_without_a_key_is_forbidden_and_says_why(
        self,
        serve_spec: ServeSpec,
        t2i_spec: Callable[..., PipelineSpec],
    ) -> None:
        """A private page on a worker with no API key is 403, naming the option to set."""
        served = serve_spec(t2i_spec(status_page="private"))
        with served.client() as client:
            answer = client.get("/")
        assert answer.status_code == 403
        assert "--api-key KEY (or LIFECYCLE_API_KEY)" in answer.json()["error"]["message"]


class TestPageAccess:
    def test_a_key_closes_the_page_unless_every_spec_opens_it(self) -> None:
        """Unset follows the key; one page shows every pipeline, so one unset or private
        spec keeps it behind the key, and private without a key closes it."""
        locked, unlocked = DoorKeys(api=Secret("sesame")), DoorKeys()
        table = {
            pages: (page_access(pages, unlocked), page_access(pages, locked))
            for pages in [(UNSET,), ("open",), ("private",), ("open", UNSET), ("open", "open")]
        }
        assert table == {
            (UNSET,): ("open", "api_key"),
            ("open",): ("open", "open"),
            ("private",): ("closed", "api_key"),
            ("open", UNSET): ("open", "api_key"),
            ("open", "open"): ("open", "open"),
        }


def test_page_assets_ship_in_the_wheel(root: Path, tmp_path: Path) -> None:
    """The built wheel carries the page's HTML, style sheet and script."""
    source = tmp_path / "source"  # a copy: building writes build/ beside the sources
    skip = shutil.ignore_patterns("__pycache__", "*.egg-info")
    for name in ("lifecycle", "components", "attention"):
        shutil.copytree(root / name, source / name, ignore=skip)
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(root / name, source / name)
    wheels = tmp_path / "wheels"
    built = run_python(BUILD_WHEEL, wheels, cwd=source)
    assert built.returncode == 0, built.stderr
    (wheel,) = wheels.glob("*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for asset in ("status.html", "status.css", "status.js"):
        assert f"lifecycle/serving/static/{asset}" in names
