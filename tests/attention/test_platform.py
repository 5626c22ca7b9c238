"""The platform: device kind, availability with reasons, preference and default."""

from __future__ import annotations

import pytest
import torch

from attention import Platform, UnknownBackendError


class TestPlatform:
    """What a platform says about the backends it can run."""

    def test_cpu_prefers_sdpa_then_flash(self, cpu: Platform) -> None:
        """On CPU the preference is torch_sdpa, torch_flash and the default torch_sdpa."""
        assert cpu.preference == ("torch_sdpa", "torch_flash")
        assert cpu.default_backend == "torch_sdpa"

    def test_cuda_preference(self) -> None:
        """On CUDA the preference is flash_attn, torch_flash, torch_sdpa."""
        assert Platform("cuda").preference == ("flash_attn", "torch_flash", "torch_sdpa")

    def test_cpu_kernels_are_available_here(self, cpu: Platform) -> None:
        """torch_sdpa, torch_flash, reference and sliding_window run on this CPU."""
        for name in ("torch_sdpa", "torch_flash", "reference", "sliding_window"):
            assert cpu.unavailable_reason(name) is None, name

    def test_flash_attn_needs_cuda(self, cpu: Platform) -> None:
        """flash_attn is unavailable on CPU, with the reason."""
        assert not cpu.is_available("flash_attn")
        assert cpu.unavailable_reason("flash_attn") == (
            "flash_attn needs a CUDA device, this platform is cpu"
        )

    def test_caller_reasons_add_to_the_backends_own(self) -> None:
        """An explicit unavailable reason makes a backend unavailable and moves the default."""
        platform = Platform("cpu", unavailable={"torch_sdpa": "banned by the operator"})
        assert platform.unavailable_reason("torch_sdpa") == "banned by the operator"
        assert platform.default_backend == "torch_flash"
        assert (
            repr(platform)
            == "Platform('cpu', unavailable={'torch_sdpa': 'banned by the operator'})"
        )

    def test_detect_matches_this_machine(self) -> None:
        """detect() says cuda exactly when torch sees a CUDA device."""
        assert Platform.detect().kind == ("cuda" if torch.cuda.is_available() else "cpu")

    def test_unknown_kind_and_backend_are_refused(self, cpu: Platform) -> None:
        """An unknown device kind or backend name raises, naming the valid ones."""
        with pytest.raises(ValueError, match="platform kind must be one of cpu, cuda, got 'tpu'"):
            Platform("tpu")  # type: ignore[arg-type]
        with pytest.raises(UnknownBackendError, match="unknown attention backend 'sdpa'"):
            cpu.unavailable_reason("sdpa")
