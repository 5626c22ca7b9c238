"""The locked door: the API key on every /v1 route, the admin key, open health routes."""

from __future__ import annotations

import re
import signal
import traceback
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import pytest

from lifecycle.serving.auth import DoorKeys, Secret
from lifecycle.spec.structs import PipelineSpec
from tests.conftest import Lifecycle
from tests.lifecycle.conftest import reference_maker
from tests.lifecycle.serving.command import serving
from tests.lifecycle.serving.conftest import (
    WATCHDOG_S,
    Served,
    Servers,
    ServeSpec,
    loopback_client,
    openai_client,
    t2i_maker,
)

SpecMaker = Callable[..., PipelineSpec]
API_KEY = "sk-api-7f3c9e1b"
ADMIN_KEY = "sk-admin-2d8a4f6c"
WRONG_KEY = "sk-wrong-5b0e9a13"


def v1_routes(served: Served) -> list[tuple[str, str]]:
    """Return (method, path) of every /v1 route the worker's app documents, parameters filled.

    Less ``/v1/events``: it follows ``serving.status_page`` with the page (test_status).
    """
    with served.client() as client:
        paths = client.get("/openapi.json").json()["paths"]
    return [
        (method.upper(), re.sub(r"\{[^}]+\}", "x", path))
        for path, methods in paths.items()
        if path.startswith("/v1") and path != "/v1/events"
        for method in methods
    ]


def auth(key: str) -> dict[str, str]:
    """Return the header that offers ``key``."""
    return {"authorization": f"Bearer {key}"}


BOTH_KEYS = DoorKeys(api=Secret(API_KEY), admin=Secret(ADMIN_KEY))


@pytest.fixture(scope="module")
def locked(module_servers: Servers, root: Path, tmp_path_factory: pytest.TempPathFactory) -> Served:
    """The module's reference pipeline with both keys, for tests that only send requests."""
    make = t2i_maker(reference_maker(root, tmp_path_factory.mktemp("locked")))
    return module_servers([make()], keys=BOTH_KEYS)


class TestApiKey:
    def test_every_v1_route_refuses_a_missing_or_wrong_key(self, locked: Served) -> None:
        """Each /v1 route answers 401 (an error object, a Bearer challenge) without the key
        and with a wrong one, and never repeats the key offered."""
        routes = v1_routes(locked)
        assert ("POST", "/v1/embeddings") in routes
        assert ("GET", "/v1/models") in routes
        assert ("DELETE", "/v1/requests/x") in routes
        with locked.client() as client:
            for method, path in routes:
                for headers in ({}, auth(WRONG_KEY), {"authorization": WRONG_KEY}):
                    response = client.request(method, path, headers=headers, json={})
                    assert response.status_code == 401, (method, path, headers)
                    assert response.headers["www-authenticate"] == "Bearer"
                    error = response.json()["error"]
                    assert error["code"] == "invalid_api_key"
                    assert re.search(r"--(api|admin)-key", error["message"])  # its key
                    assert WRONG_KEY not in response.text

    def test_the_keys_open_the_v1_routes(self, locked: Served) -> None:
        """The API key, or the admin key, opens /v1 routes; the scheme is case-insensitive."""
        with locked.client() as client:
            models = client.get("/v1/models", headers=auth(API_KEY))
            by_admin = client.get("/v1/pipeline", headers=auth(ADMIN_KEY))
            image = client.post(
                "/v1/images/generations",
                headers={"authorization": f"bearer {API_KEY}"},
                json={"prompt": "a red fox", "steps": 1},
            )
        assert models.json()["data"][0]["id"] == "tiny-t2i"
        assert by_admin.status_code == 200
        assert image.status_code == 200

    def test_health_readiness_and_metrics_stay_open(self, locked: Served) -> None:
        """/healthz, /readyz and /metrics answer 200 without any key."""
        with locked.client() as client:
            codes = [client.get(path).status_code for path in ("/healthz", "/readyz", "/metrics")]
        assert codes == [200, 200, 200]

    def test_openai_client_with_a_wrong_key_is_refused(
        self, locked: Served, openai: ModuleType
    ) -> None:
        """The openai client raises AuthenticationError (401) with a wrong key and works
        with the right one."""
        wrong = openai_client(openai, locked.url, WRONG_KEY)
        with pytest.raises(openai.AuthenticationError) as refused:
            wrong.models.list()
        right = openai_client(openai, locked.url, API_KEY)
        assert refused.value.status_code == 401
        assert refused.value.code == "invalid_api_key"
        assert [model.id for model in right.models.list()] == ["tiny-t2i"]

    def test_an_unlocked_worker_needs_no_key(
        self, serve_spec: ServeSpec, t2i_spec: SpecMaker
    ) -> None:
        """Without --api-key, /v1 routes answer whatever the client sends as a key."""
        served = serve_spec(t2i_spec())
        with served.client() as client:
            response = client.get("/v1/models", headers=auth(WRONG_KEY))
        assert response.status_code == 200


class TestAdminKey:
    def test_admin_routes_are_disabled_without_an_admin_key(
        self, serve_spec: ServeSpec, t2i_spec: SpecMaker, openai: ModuleType
    ) -> None:
        """Without --admin-key an admin route answers 403 saying how to enable it, even to
        the API key; the openai client raises PermissionDeniedError."""
        served = serve_spec(t2i_spec(), DoorKeys(api=Secret(API_KEY)))
        with served.client() as client:
            response = client.post("/v1/pipelines/tiny-t2i/sleep", headers=auth(API_KEY))
        assert response.status_code == 403
        error = response.json()["error"]
        assert error["code"] == "admin_disabled"
        assert "start it with --admin-key KEY (or LIFECYCLE_ADMIN_KEY)" in error["message"]
        client = openai_client(openai, served.url, API_KEY)
        with pytest.raises(openai.PermissionDeniedError) as denied:
            client.post("/pipelines/tiny-t2i/sleep", cast_to=object)
        assert denied.value.status_code == 403

    def test_admin_routes_need_the_admin_key(
        self, serve_spec: ServeSpec, t2i_spec: SpecMaker, openai: ModuleType
    ) -> None:
        """An admin route answers 401 to no key, a wrong one and the API key, 200 to the
        admin key; the openai client sees the same."""
        locked = serve_spec(t2i_spec(), BOTH_KEYS)  # its own: the admin key puts it to sleep
        with locked.client() as client:
            codes = [
                client.post("/v1/pipelines/tiny-t2i/sleep", headers=headers).status_code
                for headers in ({}, auth(WRONG_KEY), auth(API_KEY), auth(ADMIN_KEY))
            ]
        assert codes == [401, 401, 401, 200]
        user = openai_client(openai, locked.url, API_KEY)
        with pytest.raises(openai.AuthenticationError):
            user.post("/pipelines/tiny-t2i/sleep", cast_to=object)
        admin = openai_client(openai, locked.url, ADMIN_KEY)
        woke = admin.post("/pipelines/tiny-t2i/wake", cast_to=object)  # it slept above
        assert woke == {"name": "tiny-t2i", "state": "serving"}


class TestKeys:
    def test_keys_come_from_options_else_the_environment(self) -> None:
        """An option beats its variable; an unset one leaves that door open."""
        environ = {"LIFECYCLE_API_KEY": "from-env", "LIFECYCLE_ADMIN_KEY": "admin-env"}
        keys = DoorKeys.from_options("from-option", None, environ)
        assert keys.api is not None
        assert keys.api.matches("from-option")
        assert not keys.api.matches("from-env")
        assert keys.admin is not None
        assert keys.admin.matches("admin-env")
        assert DoorKeys.from_options(None, None, {}) == DoorKeys()

    def test_an_empty_key_is_refused(self) -> None:
        """An empty or blank key would lock nothing: a ValueError naming the option."""
        with pytest.raises(ValueError, match=r"--admin-key \(or LIFECYCLE_ADMIN_KEY\) is empty"):
            DoorKeys.from_options("k", None, {"LIFECYCLE_ADMIN_KEY": "  "})

    def test_a_key_never_shows_in_a_repr_or_a_traceback_with_locals(self) -> None:
        """repr, str and a traceback that captures every frame's locals hide the keys."""
        keys = DoorKeys.from_options(API_KEY, ADMIN_KEY, {})
        try:
            raise RuntimeError(f"failed with {keys}")
        except RuntimeError as err:
            text = "".join(
                traceback.TracebackException.from_exception(err, capture_locals=True).format()
            )
        assert "keys = DoorKeys(api=Secret(<hidden>), admin=Secret(<hidden>))" in text
        assert API_KEY not in text + repr(keys) + str(keys.api)
        assert ADMIN_KEY not in text


class TestServeCommand:
    def test_keys_never_reach_the_logs(self, root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        """`serve --api-key K` with LIFECYCLE_ADMIN_KEY, at debug level: after requests with
        the right, a wrong and no key, and a drain, no key is anywhere in the log."""
        monkeypatch.setenv("LIFECYCLE_ADMIN_KEY", ADMIN_KEY)
        spec = root / "examples" / "tiny_t2i.toml"
        with serving(spec, "--api-key", API_KEY, "--log-level", "debug") as (program, url):
            with loopback_client(url) as client:
                body = {"prompt": "a red fox", "steps": 1}
                statuses = [
                    client.post("/v1/images/generations", json=body, headers=h).status_code
                    for h in (auth(API_KEY), auth(WRONG_KEY), {}, auth(ADMIN_KEY))
                ]
                statuses.append(client.post("/v1/nothing", headers=auth(WRONG_KEY)).status_code)
            program.send_signal(signal.SIGTERM)
            code, _, text = program.wait(timeout=WATCHDOG_S)
        assert code == 0, text
        assert statuses == [200, 401, 401, 200, 404]
        assert '"api_key":true' in text
        assert '"admin_routes":true' in text
        assert '"event":"request.begin"' in text  # the debug log is not empty
        for key in (API_KEY, ADMIN_KEY, WRONG_KEY):
            assert key not in text

    def test_an_empty_key_exits_2(
        self, root: Path, lifecycle: Lifecycle, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """An empty LIFECYCLE_API_KEY is bad input: exit 2 naming it, nothing starts."""
        monkeypatch.setenv("LIFECYCLE_API_KEY", "")
        spec = root / "examples" / "tiny_t2i.toml"
        result = lifecycle("serve", spec, "--port", "0")
        assert result.returncode == 2
        assert "--api-key (or LIFECYCLE_API_KEY) is empty" in result.stderr
        assert "Traceback" not in result.stderr
