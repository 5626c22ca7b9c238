"""The registry: built-ins first, then registered and entry-point backends, by name."""

from __future__ import annotations

import pickle
import textwrap
from importlib.metadata import PathDistribution
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from attention import (
    AttentionBackend,
    AttentionImpl,
    UnknownBackendError,
    register_backend,
    registry,
)
from attention.registry import BackendRegistry
from attention.testing import SdpaImpl

BUILTINS = ("torch_sdpa", "torch_flash", "reference", "sliding_window", "flash_attn")


class PlainBackend(AttentionBackend):
    """An out-of-tree backend for registry tests."""

    name = "test_plain"
    impl_cls = SdpaImpl


class TestRegistry:
    """Lookup, registration and entry points of attention backends."""

    def test_builtins_come_first_in_order(self) -> None:
        """names() starts with the five built-ins in their documented order."""
        assert registry.names()[:5] == BUILTINS

    def test_unknown_name_lists_the_known_ones(self) -> None:
        """An unknown name raises a KeyError whose text lists every known backend."""
        with pytest.raises(UnknownBackendError) as err:
            registry.get("flash")
        assert isinstance(err.value, KeyError)
        assert str(err.value) == (
            "unknown attention backend 'flash'; known: "
            + ", ".join(registry.names())
            + "; register out-of-tree backends with attention.register_backend"
        )
        copy = pickle.loads(pickle.dumps(err.value))
        assert str(copy) == str(err.value)

    def test_register_and_unregister(self) -> None:
        """A registered backend is listed after the built-ins until it is unregistered."""
        assert register_backend(PlainBackend) is PlainBackend
        try:
            assert registry.names()[-1] == "test_plain"
            assert registry.get("test_plain") is PlainBackend
            assert PlainBackend in registry.out_of_tree()
            assert register_backend(PlainBackend) is PlainBackend  # idempotent
        finally:
            registry.unregister_backend("test_plain")
        assert "test_plain" not in registry.names()

    def test_name_clash_is_refused(self) -> None:
        """Another class under a taken name is refused, naming the holder."""

        class Clash(PlainBackend):
            name = "torch_sdpa"

        with pytest.raises(ValueError, match=r"name 'torch_sdpa' is taken by attention\.backends"):
            register_backend(Clash)

    def test_incomplete_backend_is_refused(self) -> None:
        """A backend whose implementation has no forward cannot be registered."""

        class NoForward(AttentionImpl):
            pass

        class Broken(AttentionBackend):
            name = "test_broken"
            impl_cls = NoForward

        with pytest.raises(TypeError, match="NoForward must implement forward"):
            register_backend(Broken)

    def test_builtins_cannot_be_unregistered(self) -> None:
        """Unregistering a built-in is refused."""
        with pytest.raises(ValueError, match="built-in attention backend 'reference'"):
            registry.unregister_backend("reference")

    def test_entry_points_are_loaded_and_broken_ones_reported(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """Backends of the given distribution's entry points are listed (no installed plugin
        takes part); a broken one is named in errors."""
        (tmp_path / "ext_attn.py").write_text(
            textwrap.dedent(
                """
                from attention import AttentionBackend, AttentionImpl

                class ExtImpl(AttentionImpl):
                    def forward(self, q, k, v, *, scale):
                        return q

                class ExtBackend(AttentionBackend):
                    name = "ext_attn"
                    impl_cls = ExtImpl
                """
            )
        )
        dist = tmp_path / "ext_attn-1.0.dist-info"
        dist.mkdir()
        (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: ext-attn\nVersion: 1.0\n")
        (dist / "entry_points.txt").write_text(
            "[pipeline_lifecycle.backends]\n"
            "ext_attn = ext_attn:ExtBackend\nmissing = no_such_module:Backend\n"
        )
        monkeypatch.syspath_prepend(str(tmp_path))
        fresh = BackendRegistry([PathDistribution(dist)])
        with capture_logs() as logs:
            assert fresh.names() == (*BUILTINS, "ext_attn")
            fresh.names()  # read once, not again
        assert fresh.get("ext_attn").supports_varlen() is False
        assert [e["entry_point"] for e in logs] == ["missing"]
        assert logs[0]["event"] == "attention.backend_load_failed"
        with pytest.raises(UnknownBackendError, match="entry point 'missing' failed to load"):
            fresh.get("nope")
