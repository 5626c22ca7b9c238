"""Capabilities are read from each implementation; options are validated by msgspec."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest
import torch

from attention import (
    AttentionBackend,
    AttentionImpl,
    AttentionRequirements,
    NoOptions,
    register_backend,
    registry,
)
from attention.backends import SlidingWindowOptions
from attention.testing import SdpaImpl

# B batch, H heads, S seq, D head dim

EVERYTHING = AttentionRequirements(
    packed_varlen=True, softmax_lse=True, attention_mask=True, additive_bias=True, causal=True
)
# Each capability's question on the backend, and the kernel entry that grants it, in the
# order of the README's columns.
ENTRIES = {
    "supports_varlen": "forward_varlen",
    "supports_lse": "forward_with_lse",
    "supports_mask": "forward_masked",
    "supports_bias": "forward_biased",
    "supports_causal": "forward_causal",
}


class LseOnlyImpl(SdpaImpl):
    """An out-of-tree kernel that implements forward and the LSE, nothing else."""

    def forward_with_lse(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        is_causal: bool,
        scale: float | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Attend with explicit math and return the LSE (never causal: it has no such mode)."""
        s = (q @ k.transpose(-2, -1)) * (scale or q.shape[-1] ** -0.5)  # (B, H, Sq, Sk)
        lse = torch.logsumexp(s, dim=-1)
        return torch.exp(s - lse.unsqueeze(-1)) @ v, lse


class LseOnlyBackend(AttentionBackend):
    """Register LseOnlyImpl under an out-of-tree name."""

    name = "test_lse_only"
    impl_cls = LseOnlyImpl


@pytest.fixture
def lse_only() -> Iterator[type[AttentionBackend]]:
    """LseOnlyBackend, registered for one test and unregistered after it."""
    register_backend(LseOnlyBackend)
    yield LseOnlyBackend
    registry.unregister_backend(LseOnlyBackend.name)


class TestCapabilities:
    """A backend supports exactly what its implementation overrides."""

    @pytest.mark.parametrize(
        ("name", "varlen", "lse", "mask", "bias", "causal", "sparse"),
        [
            ("torch_sdpa", False, False, True, True, True, False),
            ("torch_flash", True, True, True, False, True, False),
            ("reference", True, True, True, True, True, False),
            ("sliding_window", False, False, False, False, True, True),
            ("flash_attn", True, True, False, False, True, False),
        ],
    )
    def test_builtin_capabilities_match_the_design_table(
        self, name: str, varlen: bool, lse: bool, mask: bool, bias: bool, causal: bool, sparse: bool
    ) -> None:
        """The derived capabilities of each built-in are those of design §4.1 and §12."""
        backend = registry.get(name)
        assert backend.supports_varlen() is varlen
        assert backend.supports_lse() is lse
        assert backend.supports_mask() is mask
        assert backend.supports_bias() is bias
        assert backend.supports_causal() is causal
        assert backend.is_sparse is sparse

    @pytest.mark.parametrize("name", registry.names())
    @pytest.mark.parametrize("question", list(ENTRIES))
    def test_every_capability_is_the_override_of_its_entry(self, name: str, question: str) -> None:
        """Each backend claims a capability exactly when its kernel overrides that entry."""
        backend = registry.get(name)
        entry = ENTRIES[question]
        overrides = getattr(backend.impl_cls, entry) is not getattr(AttentionImpl, entry)
        assert getattr(backend, question)() is overrides

    def test_readme_table_is_derived_from_the_registry(self, root: Path) -> None:
        """The README's backend table says what each registered backend's kernel overrides."""
        text = (root / "README.md").read_text()
        rows = dict(re.findall(r"^\| `(\w+)` \| ((?:(?:yes|no) \| ){5}(?:yes|no)) \|$", text, re.M))
        expected = {
            name: " | ".join(
                "yes" if yes else "no"
                for yes in (
                    *(getattr(registry.get(name), q)() for q in ENTRIES),
                    registry.get(name).is_sparse,
                )
            )
            for name in registry.names()
        }
        assert rows == expected

    def test_unsupported_requirements_are_named_in_words(self) -> None:
        """Each missing capability is listed in words a message can quote."""
        assert registry.get("torch_sdpa").unsupported_requirements(EVERYTHING) == (
            "packed varlen attention",
            "softmax LSE",
        )
        assert registry.get("sliding_window").unsupported_requirements(EVERYTHING) == (
            "packed varlen attention",
            "softmax LSE",
            "attention masks",
            "an additive attention bias",
        )
        assert registry.get("torch_flash").unsupported_requirements(EVERYTHING) == (
            "an additive attention bias",
        )
        assert registry.get("reference").unsupported_requirements(EVERYTHING) == ()

    def test_out_of_tree_backend_capabilities_are_derived(
        self, lse_only: type[AttentionBackend]
    ) -> None:
        """A backend registered from outside gets its capabilities from what it overrides."""
        backend = registry.get("test_lse_only")
        assert backend is lse_only
        assert backend.supports_lse() is True
        assert backend.supports_varlen() is False
        assert backend.supports_mask() is False
        assert backend.unsupported_requirements(EVERYTHING) == (
            "packed varlen attention",
            "attention masks",
            "an additive attention bias",
            "causal attention",
        )

    def test_capability_follows_a_subclass_override(self) -> None:
        """Overriding forward_varlen in a subclass is what grants varlen, nothing else."""

        class WithVarlen(LseOnlyImpl):
            def forward_varlen(
                self,
                q: torch.Tensor,
                k: torch.Tensor,
                v: torch.Tensor,
                cu_seqlens_q: torch.Tensor,
                cu_seqlens_k: torch.Tensor,
                max_seqlen_q: int,
                max_seqlen_k: int,
                *,
                is_causal: bool,
                scale: float | None,
            ) -> torch.Tensor:
                return q

        class Derived(LseOnlyBackend):
            impl_cls = WithVarlen

        assert Derived.supports_varlen() is True
        assert LseOnlyBackend.supports_varlen() is False


class TestOptions:
    """Each backend's options_type validates its [attention.backend_options.<name>] table."""

    def test_sliding_window_window_defaults_and_validates(self) -> None:
        """window defaults to 256 and must be an integer of at least 1."""
        options = registry.get("sliding_window").options_type
        assert msgspec.convert({}, options) == SlidingWindowOptions(window=256)
        assert msgspec.convert({"window": 512}, options) == SlidingWindowOptions(window=512)
        with pytest.raises(msgspec.ValidationError, match=r"Expected `int` >= 1 - at `\$.window`"):
            msgspec.convert({"window": 0}, options)

    def test_unknown_option_is_rejected(self) -> None:
        """A key a backend does not take is an error, also for a backend with no options."""
        with pytest.raises(msgspec.ValidationError, match="unknown field `windw`"):
            msgspec.convert({"windw": 4}, registry.get("sliding_window").options_type)
        assert registry.get("torch_sdpa").options_type is NoOptions
        with pytest.raises(msgspec.ValidationError, match="unknown field `x`"):
            msgspec.convert({"x": 1}, NoOptions)

    def test_options_reach_the_kernel(self) -> None:
        """make_impl builds the kernel with the given options, and refuses foreign ones."""
        backend = registry.get("sliding_window")
        kernel = backend.make_impl(SlidingWindowOptions(window=7))
        assert kernel.options == SlidingWindowOptions(window=7)
        with pytest.raises(TypeError, match="takes options of type SlidingWindowOptions"):
            backend.make_impl(NoOptions())
