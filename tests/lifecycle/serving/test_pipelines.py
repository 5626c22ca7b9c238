"""Several pipelines in one worker over HTTP: model routing, /v1/pipelines, sleep, wake,
add, remove, swap and reload."""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest
from fastapi.routing import APIRoute
from safetensors.torch import save_file

from components import registry
from lifecycle.events import Event, RequestBegan
from lifecycle.serving.auth import DoorKeys, Secret, require_admin
from lifecycle.serving.routes.pipelines import pipelines_routes
from lifecycle.spec.structs import PipelineSpec
from tests.lifecycle.conftest import DIT_BYTES, ENCODER_BYTES, VAE_BYTES, T2iPipeline
from tests.lifecycle.serving.conftest import WATCHDOG_S, Served, Servers, ServeSpecs
from tests.lifecycle.serving.streams import EventReader, is_snapshot

ONE_DIT = DIT_BYTES + VAE_BYTES + 30_000
"""A worker budget that holds one DiT beside the VAE, never two DiTs beside it."""


ADMIN_KEY = "sk-admin-pipelines"
"""The admin key these workers open their admin routes with; every client sends it."""


def with_admin(serve_specs: ServeSpecs) -> ServeSpecs:
    """Serve as ``serve_specs`` does, with the admin routes opened by ``ADMIN_KEY``."""

    def serve(*args: Any, **kwargs: Any) -> Served:
        served = serve_specs(*args, keys=DoorKeys(admin=Secret(ADMIN_KEY)), **kwargs)
        served.headers["authorization"] = f"Bearer {ADMIN_KEY}"
        return served

    return serve


@pytest.fixture
def serve_specs(serve_specs: ServeSpecs) -> ServeSpecs:
    """Serve as the shared fixture does, with the admin routes opened by ``ADMIN_KEY``."""
    return with_admin(serve_specs)


def image(client: httpx.Client, model: str | None, seed: int = 7) -> httpx.Response:
    """Ask for one seeded two-step image of ``model`` (None: no model named)."""
    body: dict[str, Any] = {"prompt": "a red fox", "seed": seed, "steps": 2}
    if model is not None:
        body["model"] = model
    return client.post("/v1/images/generations", json=body)


def pixels(response: httpx.Response) -> str:
    """Return the image a 200 answer carries (its base64 PNG)."""
    assert response.status_code == 200, response.text
    data: str = response.json()["data"][0]["b64_json"]
    return data


def write_spec(path: Path, spec: PipelineSpec) -> Path:
    """Write ``spec`` as a JSON spec file at ``path``."""
    path.write_bytes(msgspec.json.encode(spec))
    return path


def listed(client: httpx.Client) -> dict[str, dict[str, Any]]:
    """Return ``GET /v1/pipelines``'s pipelines by name."""
    response = client.get("/v1/pipelines")
    assert response.status_code == 200
    return {p["name"]: p for p in response.json()["data"]}


class Blocker:
    """An observer that holds the next request it sees at its start, until released.

    The request is then queued and running as far as the worker knows, holding no lock.
    """

    def __init__(self) -> None:
        self.holding = threading.Event()
        self.release = threading.Event()
        self._armed = True

    def __call__(self, event: Event) -> None:
        if isinstance(event, RequestBegan) and self._armed:
            self._armed = False
            self.holding.set()
            self.release.wait(WATCHDOG_S)


def serve_twins(serve_specs: ServeSpecs, t2i_pipeline: T2iPipeline, folder: Path) -> Served:
    """Serve 'a' and 'b' (same encoder and VAE, other DiTs) from one worker under one DiT's
    budget, their spec files written in ``folder``."""
    specs = [t2i_pipeline("a"), t2i_pipeline("b", 5)]
    paths = {spec.name: write_spec(folder / f"{spec.name}.json", spec) for spec in specs}
    return serve_specs(specs, device_budget=ONE_DIT, paths=paths)


@pytest.fixture
def twins(serve_specs: ServeSpecs, t2i_pipeline: T2iPipeline, tmp_path: Path) -> Served:
    """The twins' worker of the test's own (``serve_twins``): the test changes it."""
    return serve_twins(serve_specs, t2i_pipeline, tmp_path)


@pytest.fixture(scope="module")
def module_twins() -> dict[str, Served]:
    """The module's twins' worker, once ``still_twins`` served it."""
    return {}


@pytest.fixture
def still_twins(
    module_twins: dict[str, Served],
    module_servers: Servers,
    t2i_pipeline: T2iPipeline,
    tmp_path: Path,
) -> Served:
    """The twins' worker served once for the module (``module_servers``), for the tests
    that leave it as it was: they read it, or it refuses their change. The first such
    test's folder holds its spec files."""
    if "twins" not in module_twins:
        module_twins["twins"] = serve_twins(with_admin(module_servers), t2i_pipeline, tmp_path)
    return module_twins["twins"]


class TestRouting:
    def test_model_picks_the_pipeline(self, still_twins: Served) -> None:
        """Each model answers with its own DiT, the same on every call; /v1/models lists both."""
        with still_twins.client() as client:
            a, b = pixels(image(client, "a")), pixels(image(client, "b"))
            assert pixels(image(client, "a")) == a
            assert a != b
            ids = [m["id"] for m in client.get("/v1/models").json()["data"]]
        assert ids == ["a", "b"]

    def test_several_pipelines_need_a_model(self, still_twins: Served) -> None:
        """No model where two are served is a 400 naming both; an unknown one a 404."""
        with still_twins.client() as client:
            missing, unknown = image(client, None), image(client, "c")
        assert missing.status_code == 400
        assert missing.json()["error"]["code"] == "model_required"
        assert "'a', 'b'" in missing.json()["error"]["message"]
        assert unknown.status_code == 404
        assert unknown.json()["error"]["code"] == "model_not_found"

    def test_listing_shows_the_shared_components(self, still_twins: Served) -> None:
        """/v1/pipelines gives each pipeline's state and its components' users, and what
        sharing saves."""
        with still_twins.client() as client:
            body = client.get("/v1/pipelines").json()
        a = next(p for p in body["data"] if p["name"] == "a")
        assert a["state"] == "serving"
        assert {n: c["users"] for n, c in a["components"].items()} == {
            "text_encoder": ["a", "b"],
            "transformer": ["a"],
            "vae": ["a", "b"],
        }
        assert body["shared_bytes_saved"] == ENCODER_BYTES + VAE_BYTES
        assert body["device_budget"] == ONE_DIT

    def test_the_status_page_shows_the_worker_and_every_pipeline(self, twins: Served) -> None:
        """The status stream's snapshot is the worker's: its phase, its one budget, the bytes
        held counted once, what sharing saves, and each pipeline with what it shares."""
        with twins.client() as client:
            client.post("/v1/pipelines/b/sleep")
        reader = EventReader(twins.url)
        try:
            snapshot = reader.until(is_snapshot)
        finally:
            reader.close()
        shared = twins.worker.shared
        pipelines = {p["name"]: p for p in snapshot["pipelines"]}
        assert (snapshot["phase"], snapshot["budget"]) == ("ready", ONE_DIT)
        assert snapshot["resident_bytes"] == shared.resident_bytes()
        assert snapshot["shared_bytes_saved"] == ENCODER_BYTES + VAE_BYTES
        assert {n: (p["state"], p["gate"], p["budget"]) for n, p in pipelines.items()} == {
            "a": ("serving", "open", ONE_DIT),
            "b": ("sleeping", "sleeping", ONE_DIT),
        }
        assert {c["name"]: c["shared_with"] for c in pipelines["a"]["components"]} == {
            "text_encoder": ["b"],
            "transformer": [],
            "vae": ["b"],
        }

    def test_every_admin_route_depends_on_require_admin(self, still_twins: Served) -> None:
        """Each route that changes pipelines, and only those, has the admin dependency."""
        guarded = {
            (method, route.path)
            for route in pipelines_routes(still_twins.worker).routes
            if isinstance(route, APIRoute)
            for method in route.methods
            if any(d.call is require_admin for d in route.dependant.dependencies)
        }
        assert guarded == {
            ("POST", "/v1/pipelines"),
            ("DELETE", "/v1/pipelines/{name}"),
            ("POST", "/v1/pipelines/{name}/sleep"),
            ("POST", "/v1/pipelines/{name}/wake"),
            ("POST", "/v1/pipelines/{name}/reload"),
        }


class TestSleepAndWake:
    def test_sleep_then_wake_over_http(
        self, serve_specs: ServeSpecs, t2i_pipeline: T2iPipeline
    ) -> None:
        """A sleeping pipeline answers 503 with Retry-After (no auto-wake, no wait); sleeping
        again is a 409; once woken it serves the same images."""
        served = serve_specs([t2i_pipeline("a", serving={"wake_timeout": 0})])
        with served.client() as client:
            before = pixels(image(client, "a"))
            slept = client.post("/v1/pipelines/a/sleep")
            assert slept.json() == {"name": "a", "state": "sleeping"}
            again = client.post("/v1/pipelines/a/sleep")
            asleep = image(client, "a")
            assert listed(client)["a"]["components"]["transformer"]["state"] == "offloaded"
            woke = client.post("/v1/pipelines/a/wake")
            after = pixels(image(client, "a"))
            wake_again = client.post("/v1/pipelines/a/wake")
        assert again.status_code == 409
        assert again.json()["error"]["code"] == "invalid_transition"
        assert again.json()["error"]["refusals"] == []
        assert asleep.status_code == 503
        assert asleep.headers["retry-after"] == "1"
        assert asleep.json()["error"]["code"] == "pipeline.asleep"
        assert woke.json() == {"name": "a", "state": "serving"}
        assert after == before
        assert wake_again.status_code == 409

    def test_a_request_wakes_a_pipeline_with_auto_wake(
        self, serve_specs: ServeSpecs, t2i_pipeline: T2iPipeline
    ) -> None:
        """With serving.auto_wake, a request for a sleeping pipeline wakes it and is answered."""
        served = serve_specs([t2i_pipeline("a", serving={"auto_wake": True})])
        with served.client() as client:
            before = pixels(image(client, "a"))
            client.post("/v1/pipelines/a/sleep").raise_for_status()
            after = pixels(image(client, "a"))
            state = listed(client)["a"]["state"]
        assert (after, state) == (before, "serving")

    def test_sleep_waits_for_the_request_in_flight(
        self, serve_specs: ServeSpecs, t2i_pipeline: T2iPipeline
    ) -> None:
        """A sleep asked while a request runs waits for it; a request that comes meanwhile
        waits at the gate, through the sleep, and is answered once the pipeline wakes."""
        served = serve_specs([t2i_pipeline("a")])
        blocker = Blocker()
        served.worker.orchestrator.observe(blocker)
        with served.client() as client, ThreadPoolExecutor(4) as pool:
            running = pool.submit(image, client, "a")
            blocker.holding.wait(WATCHDOG_S)
            sleeping = pool.submit(client.post, "/v1/pipelines/a/sleep")
            _until(lambda: listed(client)["a"]["gate"] == "sleeping")
            waiting = pool.submit(image, client, "a")
            blocker.release.set()
            assert sleeping.result().json() == {"name": "a", "state": "sleeping"}
            assert running.result().status_code == 200
            assert not waiting.done()
            client.post("/v1/pipelines/a/wake").raise_for_status()
            assert waiting.result().status_code == 200

    def test_a_drain_answers_the_requests_waiting_for_a_sleeper(
        self, serve_specs: ServeSpecs, t2i_pipeline: T2iPipeline
    ) -> None:
        """SIGTERM's drain answers a request that waits for a sleeping pipeline: 503 draining."""
        served = serve_specs([t2i_pipeline("a")])
        with served.client() as client, ThreadPoolExecutor(2) as pool:
            client.post("/v1/pipelines/a/sleep").raise_for_status()
            waiting = pool.submit(image, client, "a")
            _until(lambda: listed(client)["a"]["waiting"] == 1)
            served.worker.drain()
            answer = waiting.result()
        assert answer.status_code == 503
        assert answer.json()["error"]["code"] == "draining"


class TestChanges:
    def test_add_then_remove(
        self, serve_specs: ServeSpecs, t2i_pipeline: T2iPipeline, tmp_path: Path
    ) -> None:
        """POST /v1/pipelines serves a new spec (sharing what it can); DELETE drains and
        releases it; requests for it are then 404."""
        served = serve_specs([t2i_pipeline("a")])
        path = write_spec(tmp_path / "b.json", t2i_pipeline("b", 5))
        with served.client() as client:
            added = client.post("/v1/pipelines", json={"path": str(path)})
            b = pixels(image(client, "b"))
            users = listed(client)["b"]["components"]["text_encoder"]["users"]
            removed = client.delete("/v1/pipelines/b")
            gone = image(client, "b")
            a = image(client, "a")
        assert (added.status_code, added.json()["action"]) == (201, "added")
        assert b
        assert users == ["a", "b"]
        assert (removed.status_code, removed.json()["action"]) == (200, "removed")
        assert gone.status_code == 404
        assert a.status_code == 200

    def test_a_refused_spec_changes_nothing(
        self, still_twins: Served, t2i_pipeline: T2iPipeline, tmp_path: Path
    ) -> None:
        """A spec admission refuses is a 409 with every refusal; the worker is as before."""
        refused = t2i_pipeline("c", vae={"attention_backend": "flash_attn"})
        path = write_spec(tmp_path / "c.json", refused)
        with still_twins.client() as client:
            before = listed(client)
            answer = client.post("/v1/pipelines", json={"path": str(path)})
            after = listed(client)
        assert answer.status_code == 409
        codes = {r["code"] for r in answer.json()["error"]["refusals"]}
        assert codes == {"attention.unsupported_backend"}
        assert after == before

    def test_paths_no_file_system_names_are_400s(self, still_twins: Served) -> None:
        """A path longer than PATH_MAX, or with a name longer than the file system allows,
        is a 400 at ``path`` in a short answer (the second was a 500), the worker as before."""
        with still_twins.client() as client:
            before = listed(client)
            answers = [
                client.post("/v1/pipelines", json={"path": "p" * 20_000}),
                client.post("/v1/pipelines", json={"path": "x" * 300 + ".toml"}),
            ]
            after = listed(client)
        for answer in answers:
            assert answer.status_code == 400, answer.text
            assert answer.json()["error"]["param"] == "path"
            assert len(answer.content) < 1_000
        assert after == before

    def test_reload_unchanged_then_changed(
        self, twins: Served, t2i_pipeline: T2iPipeline, tmp_path: Path
    ) -> None:
        """Reloading an unchanged spec touches nothing; a changed one is swapped in, keeping
        the components both share loaded."""
        with twins.client() as client:
            before = pixels(image(client, "a"))
            unchanged = client.post("/v1/pipelines/a/reload")
            write_spec(tmp_path / "a.json", t2i_pipeline("a", 9))
            swapped = client.post("/v1/pipelines/a/reload")
            after = pixels(image(client, "a"))
        assert unchanged.json()["action"] == "unchanged"
        assert swapped.status_code == 200, swapped.text
        assert (swapped.json()["action"], swapped.json()["restored"]) == ("swapped", False)
        assert swapped.json()["kept"] == ["text_encoder", "vae"]
        assert after != before

    def test_a_swap_that_fails_to_load_restores_the_old_one(
        self, serve_specs: ServeSpecs, t2i_pipeline: T2iPipeline, tmp_path: Path
    ) -> None:
        """A new pipeline that fails at load (NaN weights pass check) leaves the old one
        serving; the request in flight and those that waited through the swap are answered."""
        pinned = {"residency": "resident"}
        old = t2i_pipeline("a", transformer=pinned)
        served = serve_specs([old], device_budget=DIT_BYTES + VAE_BYTES + ENCODER_BYTES)
        vae = registry.get("tiny_vae").from_options({}).build("custom")
        tensors = {n: t.clone() for n, t in vae.state_dict().items()}
        next(iter(tensors.values())).view(-1)[0] = float("nan")
        save_file(tensors, str(tmp_path / "nan.safetensors"))
        broken = t2i_pipeline(
            "a",
            transformer=pinned,
            vae={"options": {"weights": str(tmp_path / "nan.safetensors")}},
        )
        path = write_spec(tmp_path / "broken.json", broken)
        with served.client() as client, ThreadPoolExecutor(6) as pool:
            expected = pixels(image(client, "a"))
            blocker = Blocker()
            served.worker.orchestrator.observe(blocker)
            running = pool.submit(image, client, "a")
            blocker.holding.wait(WATCHDOG_S)
            swapping = pool.submit(client.post, "/v1/pipelines", json={"path": str(path)})
            _until(lambda: listed(client)["a"]["gate"] == "swapping")
            state = listed(client)["a"]["state"]  # the old one, until its request is done
            waiting: list[Future[httpx.Response]] = [
                pool.submit(image, client, "a") for _ in range(3)
            ]
            blocker.release.set()
            answer = swapping.result()
            answers = [running.result(), *(f.result() for f in waiting)]
            later = image(client, "a")
        assert answer.status_code == 500
        assert state == "swapping"
        assert (answer.json()["restored"], answer.json()["overlapped"]) == (True, False)
        assert "NaN or infinity" in answer.json()["cause"]
        assert [pixels(a) for a in answers] == [expected] * 4
        assert pixels(later) == expected


def _until(condition: Callable[[], bool]) -> None:
    """Wait until ``condition`` holds (the watchdog bounds it)."""
    for _ in range(int(WATCHDOG_S / 0.01)):
        if condition():
            return
        threading.Event().wait(0.01)
    raise AssertionError("the condition never held")
