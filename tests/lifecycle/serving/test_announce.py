"""The lines ``lifecycle serve`` says to a person, for every status page access."""

from __future__ import annotations

import pytest

from lifecycle.serving.announce import base_url, draining_line, ready_line
from lifecycle.serving.auth import DoorKeys, PageAccess, Secret

LOCKED = DoorKeys(api=Secret("sk-api"), admin=Secret("sk-admin"))


class TestReadyLine:
    @pytest.mark.parametrize(
        ("keys", "page", "said"),
        [
            (DoorKeys(), "open", "(open)"),
            (LOCKED, "open", '(open to every client: serving.status_page = "open")'),
            (LOCKED, "api_key", "(behind the API key)"),
            (DoorKeys(), "closed", '(closed: serving.status_page = "private" needs --api-key)'),
        ],
        ids=["open", "opened", "behind", "closed"],
    )
    def test_says_who_reads_the_status_page(
        self, keys: DoorKeys, page: PageAccess, said: str
    ) -> None:
        """The line names the page's URL and who may read it; a page a key would keep is
        said to be open by the spec's choice."""
        line = ready_line("http://127.0.0.1:8000", ["a", "b"], keys, page)
        assert line.startswith("lifecycle serve: ready on http://127.0.0.1:8000, pipelines a, b; ")
        assert line.endswith(f"; status page http://127.0.0.1:8000/ {said}")

    def test_says_whether_keys_are_set_never_which(self) -> None:
        """Both keys set: the line says so and holds neither."""
        line = ready_line("http://h:1", ["p"], LOCKED, "api_key")
        assert "API key set, admin key set;" in line
        assert "sk-" not in line

    def test_an_ipv6_host_is_bracketed(self) -> None:
        """An IPv6 address is written in brackets in the URL."""
        assert base_url("::1", 8000) == "http://[::1]:8000"
        assert base_url("0.0.0.0", 80) == "http://0.0.0.0:80"


class TestDrainingLine:
    def test_counts_what_is_left(self) -> None:
        """The line says how many requests finish first, or that none is left."""
        assert "the 1 request queued or running finish first" in draining_line("SIGTERM", 1)
        assert "nothing is queued or running" in draining_line("SIGINT", 0)
