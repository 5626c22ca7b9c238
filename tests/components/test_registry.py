"""The kind registry: built-ins first, then registered and entry-point kinds, by name."""

from __future__ import annotations

import pickle
from importlib.metadata import PathDistribution
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from components import registry
from components.generic import GenericLoader
from components.kinds import BUILTIN_KINDS
from components.registry import KindRegistry, UnknownKindError
from tests.lifecycle.kinds_for_tests import NativeOnlyKind

BUILTINS = (
    "tiny_text_encoder",
    "tiny_dit",
    "tiny_vae",
    "tiny_upsampler",
    "minilm_text_encoder",
    "t5_encoder",
    "clip_text_encoder",
    "pixart_transformer",
    "flux_transformer",
    "sd3_transformer",
    "autoencoder_kl",
    "llm_text_encoder",
    "qwen_image_transformer",
    "autoencoder_kl_qwen_image",
    "z_image_transformer",
    "flux2_transformer",
    "autoencoder_kl_flux2",
    "umt5_encoder",
    "clip_vision_encoder",
    "wan_transformer",
    "autoencoder_kl_wan",
)


def distribution(tmp_path: Path, entry_points: str) -> PathDistribution:
    """Return a distribution over a ``*.dist-info`` folder whose kinds are ``entry_points``."""
    dist = tmp_path / "kinds_test-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: kinds-test\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text(f"[pipeline_lifecycle.kinds]\n{entry_points}")
    return PathDistribution(dist)


class TestKindRegistry:
    """Lookup, registration and entry points of component kinds."""

    def test_builtins_come_first_in_order(self) -> None:
        """names() starts with the built-in kinds, in the order BUILTIN_KINDS lists them."""
        assert tuple(loader.kind for loader in BUILTIN_KINDS) == BUILTINS
        assert registry.names()[: len(BUILTINS)] == BUILTINS

    def test_unknown_kind_lists_the_known_ones(self) -> None:
        """An unknown kind raises a KeyError naming every known kind and where kinds come from."""
        with pytest.raises(UnknownKindError) as err:
            registry.get("tiny_ditt")
        assert isinstance(err.value, KeyError)
        assert str(err.value) == (
            f"unknown component kind 'tiny_ditt'; known: {', '.join(registry.names())}; "
            "a package adds kinds through the entry-point group 'pipeline_lifecycle.kinds'"
        )
        assert str(pickle.loads(pickle.dumps(err.value))) == str(err.value)

    def test_register_and_unregister(self) -> None:
        """A registered kind is listed after the built-ins until it is unregistered."""
        assert registry.register_kind(NativeOnlyKind) is NativeOnlyKind
        try:
            assert registry.names()[-1] == "test_native_only"
            assert registry.get("test_native_only") is NativeOnlyKind
            assert registry.register_kind(NativeOnlyKind) is NativeOnlyKind  # idempotent
        finally:
            registry.unregister_kind("test_native_only")
        assert "test_native_only" not in registry.names()

    def test_name_clash_is_refused(self) -> None:
        """Another loader under a taken kind is refused, naming the holder."""

        class Clash(NativeOnlyKind):
            kind = "tiny_vae"

        with pytest.raises(
            ValueError,
            match=r"component kind name 'tiny_vae' is taken by components\.kinds\.tiny_vae",
        ):
            registry.register_kind(Clash)

    def test_only_loaders_are_registered(self) -> None:
        """Registering anything but a ComponentLoader subclass is a TypeError naming it."""
        with pytest.raises(TypeError, match="register_kind takes a ComponentLoader subclass"):
            registry.register_kind(GenericLoader.for_factory)  # type: ignore[arg-type]

    def test_builtins_cannot_be_unregistered(self) -> None:
        """Unregistering a built-in kind is refused."""
        with pytest.raises(ValueError, match="built-in component kind 'tiny_dit'"):
            registry.unregister_kind("tiny_dit")

    def test_a_registry_reads_only_its_distributions(self, tmp_path: Path) -> None:
        """A registry over one distribution lists its kinds, loader or factory, and names each
        broken entry point with why; the process-wide registry does not see them."""
        dist = distribution(
            tmp_path,
            "test_native_only = tests.lifecycle.kinds_for_tests:NativeOnlyKind\n"
            "test_factory = tests.plugin.ext:make_plain\n"
            "misnamed = tests.lifecycle.kinds_for_tests:NativeOnlyKind\n"
            "missing = no_such_module:Kind\n",
        )
        fresh = KindRegistry([dist])
        with capture_logs() as logs:
            assert fresh.names() == (*BUILTINS, "test_native_only", "test_factory")
            fresh.names()  # read once, not again
        assert fresh.get("test_native_only") is NativeOnlyKind
        factory = fresh.get("test_factory")
        assert issubclass(factory, GenericLoader)
        assert factory.kind == "test_factory"
        assert [(e["event"], e["entry_point"]) for e in logs] == [
            ("components.kind_load_failed", "misnamed"),
            ("components.kind_load_failed", "missing"),
        ]
        with pytest.raises(UnknownKindError) as err:
            fresh.get("nope")
        assert "whose kind is 'test_native_only'; name the entry point after the kind" in str(
            err.value
        )
        assert "entry point 'missing' failed to load (ModuleNotFoundError" in str(err.value)
        assert "test_factory" not in registry.names()
