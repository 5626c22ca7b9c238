"""The per-request attention backend override (design §4.6): its rules, per request, cached."""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Iterator
from typing import Any, ClassVar

import msgspec
import pytest
import torch

from attention import (
    Attention,
    AttentionRequirements,
    AttentionRole,
    BackendRequest,
    PlannedSelection,
    Platform,
    Provenance,
    Selection,
    register_backend,
)
from attention.backends.torch_flash import TorchFlashBackend, TorchFlashImpl
from attention.registry import unregister_backend
from components.batch import Batch
from lifecycle.orchestrator import Orchestrator
from lifecycle.override import RequestRefused, override_refusals
from lifecycle.refusals import RefusalCode, Refused, TransitionRefused
from tests.lifecycle.conftest import ReferenceSpec

CALLS: Counter[tuple[str, int]] = Counter()
"""(backend, thread id) -> kernel calls, written by the counting backends below."""


class CountingImpl(TorchFlashImpl):
    """torch_flash's kernel that counts its packed calls per backend and thread."""

    backend = ""

    def forward_varlen(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        """Count the call, then run torch_flash's packed kernel."""
        CALLS[(self.backend, threading.get_ident())] += 1
        return super().forward_varlen(*args, **kwargs)


class CountingA(CountingImpl):
    """Counts under 'counting_a'."""

    backend = "counting_a"


class CountingB(CountingImpl):
    """Counts under 'counting_b'."""

    backend = "counting_b"


class CountingBackendA(TorchFlashBackend):
    """An out-of-tree backend that counts its kernel calls."""

    name: ClassVar[str] = "counting_a"  # type: ignore[misc]
    impl_cls = CountingA


class CountingBackendB(TorchFlashBackend):
    """A second out-of-tree backend that counts its kernel calls."""

    name: ClassVar[str] = "counting_b"  # type: ignore[misc]
    impl_cls = CountingB


class BrokenImpl(TorchFlashImpl):
    """A kernel that cannot be built (as a missing compiled library would fail)."""

    def __init__(self, options: msgspec.Struct) -> None:
        raise OSError("libbroken.so: cannot open shared object file")


class BrokenBackend(TorchFlashBackend):
    """An out-of-tree backend whose kernel fails to build."""

    name: ClassVar[str] = "broken"  # type: ignore[misc]
    impl_cls = BrokenImpl


@pytest.fixture
def counting() -> Iterator[None]:
    """Register the counting and broken backends for one test, then remove them."""
    for backend in (CountingBackendA, CountingBackendB, BrokenBackend):
        register_backend(backend)
    CALLS.clear()
    yield
    for backend in (CountingBackendA, CountingBackendB, BrokenBackend):
        unregister_backend(backend.name)


def generate(orch: Orchestrator, backend: str | None = None, seed: int = 0) -> torch.Tensor:
    """Run one request through every stage, optionally overriding the backend."""
    batch = Batch(generator=torch.Generator().manual_seed(seed), steps=2)
    with orch.request(attention_backend=backend) as request:
        request.run_all(batch)
    assert batch.images is not None
    return batch.images


def refused(orch: Orchestrator, backend: str) -> RequestRefused:
    """Return the refusal of a request that names ``backend``."""
    with pytest.raises(RequestRefused) as err:
        generate(orch, backend)
    return err.value


def planned(
    backend: str,
    *,
    supported: frozenset[str] | None = None,
    ring: bool = False,
    requirements: AttentionRequirements | None = None,
) -> dict[str, dict[str, PlannedSelection]]:
    """Return one switchable DiT self site that admission planned on ``backend``."""
    request = BackendRequest(
        component="transformer",
        site="self",
        role=AttentionRole.SELF,
        requirements=requirements or AttentionRequirements(),
        supported=supported,
        ring=ring,
    )
    selection = Selection(backend=backend, reason=None, provenance=Provenance.DEFAULT)
    return {"transformer": {"self": PlannedSelection(request=request, selection=selection)}}


@pytest.fixture
def loaded(reference_spec: ReferenceSpec, cpu: Platform) -> Iterator[Orchestrator]:
    """The reference pipeline, loaded on the CPU platform."""
    with Orchestrator(reference_spec(), platform=cpu) as orch:
        orch.load()
        yield orch


class TestOverrideRules:
    def test_unknown_name_is_refused(self, loaded: Orchestrator) -> None:
        """A name no registry knows refuses the whole request, listing the known names."""
        err = refused(loaded, "flash_attn_9")
        assert err.codes == (RefusalCode.INVALID_OVERRIDE,)
        assert "'flash_attn_9' is not a known backend" in err.refusals[0].message
        assert "torch_flash" in err.refusals[0].hint

    def test_request_and_transition_refusals_share_a_base(self, loaded: Orchestrator) -> None:
        """A refused request and a refused move are both caught as Refused, with their codes."""
        caught: list[Refused] = []
        for refuse in (
            lambda: generate(loaded, "flash_attn_9"),
            lambda: loaded.offload("transformer"),
        ):
            with pytest.raises(Refused) as err:
                refuse()
            caught.append(err.value)
        assert [type(err) for err in caught] == [RequestRefused, TransitionRefused]
        assert [err.codes for err in caught] == [
            (RefusalCode.INVALID_OVERRIDE,),
            (RefusalCode.NOT_OFFLOADABLE,),
        ]

    def test_sparse_target_is_refused(self, loaded: Orchestrator) -> None:
        """A sparse target is refused: a request never swaps in an approximation."""
        err = refused(loaded, "sliding_window")
        assert err.codes == (RefusalCode.INVALID_OVERRIDE,)
        assert "is sparse" in err.refusals[0].message

    def test_site_with_sparse_default_is_refused(self, cpu: Platform) -> None:
        """A switchable site that runs a sparse backend by default refuses any override."""
        refusals = override_refusals("torch_flash", planned("sliding_window"), cpu)
        assert [r.code for r in refusals] == [RefusalCode.INVALID_OVERRIDE]
        assert "runs the sparse backend 'sliding_window' by default" in refusals[0].message

    def test_no_switchable_site_is_refused(
        self, reference_spec: ReferenceSpec, cpu: Platform
    ) -> None:
        """With the denoiser's backend set in the spec nothing is switchable: refused."""
        spec = reference_spec(transformer={"attention_backend": "torch_flash"})
        with Orchestrator(spec, platform=cpu) as orch:
            orch.load()
            err = refused(orch, "reference")
        assert err.codes == (RefusalCode.INVALID_OVERRIDE,)
        assert "no switchable attention site" in err.refusals[0].message

    def test_missing_capability_is_refused(self, loaded: Orchestrator) -> None:
        """A target without packed varlen cannot run the DiT's packed self site: refused."""
        err = refused(loaded, "torch_sdpa")
        assert err.codes == (RefusalCode.CAPABILITY_MISSING,)
        assert err.refusals[0].component == "transformer"
        assert "(torch_flash, reference)" in err.refusals[0].hint

    def test_unsupported_backend_is_refused(self, cpu: Platform) -> None:
        """A target outside a switchable site's supported set is refused."""
        sites = planned("torch_flash", supported=frozenset({"torch_flash"}))
        refusals = override_refusals("reference", sites, cpu)
        assert [r.code for r in refusals] == [RefusalCode.UNSUPPORTED_BACKEND]

    def test_ring_without_lse_is_refused(self, cpu: Platform) -> None:
        """Under ring attention a target without the softmax LSE is refused."""
        refusals = override_refusals("torch_sdpa", planned("torch_flash", ring=True), cpu)
        assert [r.code for r in refusals] == [RefusalCode.RING_REQUIRES_LSE]

    def test_unavailable_target_is_refused_not_fallen_back(self, loaded: Orchestrator) -> None:
        """A target the platform cannot run is refused; it never resolves to another one."""
        err = refused(loaded, "flash_attn")
        assert err.codes == (RefusalCode.UNAVAILABLE_BACKEND,) * 2  # the self and cross sites


class TestOverrideRuns:
    def test_override_switches_only_switchable_sites(self, loaded: Orchestrator) -> None:
        """Overridden, the DiT runs the target; the encoder and VAE keep the spec's choice."""
        baseline = generate(loaded)
        switched = generate(loaded, "reference")
        layers = [m for m in loaded.module("transformer").modules() if isinstance(m, Attention)]
        assert all(layer.prepared_backends == {"reference"} for layer in layers)
        for name in ("text_encoder", "vae"):
            others = [m for m in loaded.module(name).modules() if isinstance(m, Attention)]
            assert not any(layer.is_switchable for layer in others)
        assert (switched - baseline).abs().max() < 1e-5  # float32 reference vs fused kernel
        assert torch.equal(generate(loaded), baseline)  # no override: the spec's choices

    def test_concurrent_overrides_each_run_their_own_backend(
        self, loaded: Orchestrator, counting: None
    ) -> None:
        """Two threads with different overrides: each kernel counts calls from its thread only."""
        barrier = threading.Barrier(2)
        idents: dict[str, int] = {}
        errors: list[BaseException] = []

        def serve(backend: str) -> None:
            idents[backend] = threading.get_ident()
            try:
                barrier.wait(timeout=30)
                for seed in range(3):
                    generate(loaded, backend, seed)
            except BaseException as err:  # re-raised below, in the main thread
                errors.append(err)

        threads = [threading.Thread(target=serve, args=(b,)) for b in ("counting_a", "counting_b")]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=120)
        assert not errors, errors
        layers = loaded.spec.components["transformer"].options.get("layers", 2)
        per_thread = 3 * 2 * layers  # requests x steps x self-attention layers
        expected = {
            ("counting_a", idents["counting_a"]): per_thread,
            ("counting_b", idents["counting_b"]): per_thread,
        }
        assert dict(CALLS) == expected

    def test_failed_prepare_switches_nothing(self, loaded: Orchestrator, counting: None) -> None:
        """A kernel that fails to build leaves every layer unswitched; the next request runs."""
        with pytest.raises(OSError, match="libbroken"):
            generate(loaded, "broken")
        layers = [m for m in loaded.module("transformer").modules() if isinstance(m, Attention)]
        assert not any("broken" in layer.prepared_backends for layer in layers)
        assert generate(loaded).shape[0] == 1
