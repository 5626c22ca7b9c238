"""The reference kinds: real modules, real kernels, seeded weights, declared sites that run."""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from functools import wraps
from pathlib import Path
from typing import Any

import msgspec
import pytest
import torch
from safetensors.torch import save_model
from torch import nn

from attention import (
    GLOBAL_BACKEND_FALLBACK,
    PLATFORM_DEFAULT_FALLBACK,
    Attention,
    AttentionRequirements,
    AttentionRole,
    BackendChoice,
    BackendSelectionError,
    ComponentRequests,
    NotResidentError,
    PlannedSelection,
    Platform,
    Provenance,
    arm_layers,
    component_attention_scope,
    select_backend,
)
from components import registry
from components.batch import Batch
from components.kinds import tiny_dit, tiny_text_encoder, tiny_upsampler, tiny_vae
from components.kinds.tiny_dit import TinyDitLoader
from components.kinds.tiny_text_encoder import TinyTextEncoderLoader
from components.kinds.tiny_upsampler import TinyUpsamplerLoader
from components.kinds.tiny_vae import TinyVaeLoader
from components.loader import ComponentLoader, SeededOptions
from tests.components.standalone import STANDALONE_KINDS

INPUT_SEED = 1234

# Every registered kind, so a new kind is covered without editing this file; the lists are
# made at collection, when only the built-in kinds (and installed entry points) are known.
KINDS = STANDALONE_KINDS
SEEDED = [k for k in KINDS if issubclass(registry.get(k).options_type, SeededOptions)]
WITH_SITES = [k for k in KINDS if registry.get(k).from_options({}).sites()]
# what a request carries only once a kind's run has written it
PRODUCED = [f.name for f in dataclasses.fields(Batch) if f.default is None]

# kind -> the function that makes its forward's arguments (for the per-kind tests below)
EXAMPLES: dict[str, Callable[..., tuple[Any, ...]]] = {
    "tiny_text_encoder": tiny_text_encoder.example_inputs,
    "tiny_dit": tiny_dit.example_inputs,
    "tiny_vae": tiny_vae.example_inputs,
    "tiny_upsampler": tiny_upsampler.example_inputs,
}


def loader_of(kind: str, **options: Any) -> ComponentLoader:
    """Return the registered loader of ``kind`` with ``options`` validated."""
    return registry.get(kind).from_options(options)


def buildable(kind: str) -> ComponentLoader:
    """Return the loader of ``kind``; skip the test where its custom path cannot build here."""
    loader = loader_of(kind)
    reason = loader.unavailable_reason("custom")
    if reason is not None:
        pytest.skip(reason)
    return loader


def inputs_for(loader: ComponentLoader, batch: int = 2) -> tuple[Any, ...]:
    """Return the kind's seeded example inputs."""
    generator = torch.Generator().manual_seed(INPUT_SEED)
    return EXAMPLES[loader.kind](loader.options, batch, generator)


def serve(loader: ComponentLoader, module: nn.Module) -> dict[str, object]:
    """Serve one seeded request of two prompts through ``loader.run``; return what it wrote."""
    batch = Batch(generator=torch.Generator().manual_seed(INPUT_SEED), size=2, steps=1)
    with torch.inference_mode():
        loader.run(module, batch)
    return {name: getattr(batch, name) for name in PRODUCED if getattr(batch, name) is not None}


def same(a: object, b: object) -> bool:
    """Tell whether two served values (tensors, lists, dicts of them) are bit-identical."""
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return torch.equal(a, b)
    if isinstance(a, list | tuple) and isinstance(b, list | tuple):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[key], b[key]) for key in a)
    return a == b


def build_armed(loader: ComponentLoader, path: str = "custom") -> nn.Module:
    """Build ``path`` outside any scope and arm its attention layers, as onload would."""
    module = loader.build(path)  # type: ignore[arg-type]
    arm_layers(module)
    return module


def run(module: nn.Module, inputs: tuple[Any, ...]) -> torch.Tensor:
    """Call the module; a list of per-request outputs comes back concatenated."""
    out = module(*inputs)
    return torch.cat(out) if isinstance(out, list) else out


def layers_of(module: nn.Module) -> list[Attention]:
    """Return every attention layer under ``module``."""
    return [m for m in module.modules() if isinstance(m, Attention)]


def declared(loader: ComponentLoader) -> set[tuple[str, AttentionRole, AttentionRequirements]]:
    """Return what the loader's ``sites()`` declare, in the terms a layer records."""
    return {(s.name, s.role, s.requirements) for s in loader.sites() or ()}


def constructed(module: nn.Module) -> set[tuple[str, AttentionRole, AttentionRequirements]]:
    """Return the site, role and requirements of every layer actually built."""
    return {(layer.site, layer.role, layer.requirements) for layer in layers_of(module)}


@contextmanager
def kernel_calls(module: nn.Module) -> Iterator[Counter[str]]:
    """Count kernel calls per site while the block runs.

    Dense calls go through ``nn.Module.__call__`` and are seen by a forward hook;
    ``forward_varlen`` is a plain method that hooks never see, so each layer's bound
    method is wrapped (the real kernel still runs) for as long as the block lasts.
    """
    counts: Counter[str] = Counter()
    handles = []
    for layer in layers_of(module):
        site = layer.site
        handles.append(layer.register_forward_hook(lambda *_, s=site: counts.update([s])))
        real = layer.forward_varlen

        @wraps(real)
        def counted(*args: Any, _real: Any = real, _site: str = site, **kwargs: Any) -> Any:
            counts.update([_site])
            return _real(*args, **kwargs)

        layer.forward_varlen = counted  # type: ignore[method-assign]
    try:
        yield counts
    finally:
        for handle in handles:
            handle.remove()
        for layer in layers_of(module):
            del layer.forward_varlen


def plan_for(
    loader: ComponentLoader, requests: ComponentRequests, platform: Platform
) -> dict[str, PlannedSelection]:
    """Plan every declared site as admission does: ``select_backend`` on ``platform``."""
    return {
        site.name: PlannedSelection(
            request=(request := site.request_in(requests)),
            selection=select_backend(request, platform),
        )
        for site in loader.sites() or ()
    }


def explicit(name: str) -> BackendChoice:
    """Return an explicit (strict) request for backend ``name``."""
    return BackendChoice(name=name, provenance=Provenance.EXPLICIT)


def assert_golden(out: torch.Tensor, total: float, head: list[float]) -> None:
    """Check a seeded output against its recorded sum and first elements."""
    assert out.sum().item() == pytest.approx(total, abs=1e-4)
    assert out.flatten()[: len(head)].tolist() == pytest.approx(head, abs=1e-4)


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """Return the largest absolute difference of two tensors."""
    return (a - b).abs().max().item()


def same_state(a: Mapping[str, torch.Tensor], b: Mapping[str, torch.Tensor]) -> bool:
    """Tell whether two state dicts have the same names and bit-identical tensors."""
    return a.keys() == b.keys() and all(torch.equal(a[name], b[name]) for name in a)


class TestEveryKind:
    """Behaviour every registered kind shares."""

    @pytest.mark.parametrize("kind", KINDS)
    def test_kind_is_registered(self, kind: str) -> None:
        """Each registered kind is found in the registry under its own name."""
        assert registry.get(kind).kind == kind
        assert kind in registry.names()

    @pytest.mark.parametrize("kind", KINDS)
    def test_sites_match_the_layers_built(self, kind: str) -> None:
        """The sites a kind declares are exactly the sites of the layers its custom path builds."""
        loader = buildable(kind)
        assert constructed(loader.build("custom")) == declared(loader)

    @pytest.mark.parametrize("kind", SEEDED)
    def test_same_seed_same_weights(self, kind: str) -> None:
        """Two builds with one seed are bit-identical; another seed changes every float tensor."""
        first = loader_of(kind, seed=7).build("custom").state_dict()
        again = loader_of(kind, seed=7).build("custom").state_dict()
        other = loader_of(kind, seed=8).build("custom").state_dict()
        assert same_state(first, again)
        assert all(not torch.equal(first[name], other[name]) for name in first)

    @pytest.mark.parametrize("kind", SEEDED)
    def test_safetensors_round_trip(self, kind: str, tmp_path: Path) -> None:
        """Weights saved to safetensors and built back from the file give identical outputs."""
        source = build_armed(loader_of(kind, seed=3))
        path = tmp_path / f"{kind}.safetensors"
        save_model(source, str(path))
        loaded = build_armed(loader_of(kind, weights=str(path)))
        served = serve(loader_of(kind), source)
        assert served
        assert same_state(source.state_dict(), loaded.state_dict())
        assert same(served, serve(loader_of(kind), loaded))

    @pytest.mark.parametrize("kind", KINDS)
    def test_unknown_option_is_refused(self, kind: str) -> None:
        """An option the kind does not know is a validation error naming it."""
        with pytest.raises(msgspec.ValidationError) as err:
            registry.get(kind).from_options({"depth": 3})
        assert str(err.value) == "Object contains unknown field `depth`"

    @pytest.mark.parametrize("kind", WITH_SITES)
    def test_built_layers_start_disarmed(self, kind: str) -> None:
        """A freshly built component's attention layers refuse to run until armed."""
        loader = buildable(kind)
        module = loader.build("custom")
        with pytest.raises(NotResidentError):
            serve(loader, module)


class TestTinyTextEncoder:
    """``tiny_text_encoder``: token ids and a padding mask to embeddings."""

    def test_output_shape_and_finite(self) -> None:
        """Embeddings are (B, S, dim) and finite for rows with padding."""
        loader = loader_of("tiny_text_encoder", dim=48, heads=6)
        tokens, mask = inputs_for(loader, batch=3)
        out = build_armed(loader)(tokens, mask)
        assert out.shape == (3, tokens.shape[1], 48)
        assert not mask.all()
        assert torch.isfinite(out).all()

    def test_every_layer_of_the_self_site_runs(self) -> None:
        """One forward runs the self site's kernel once per encoder layer."""
        loader = loader_of("tiny_text_encoder", layers=3)
        module = build_armed(loader)
        with kernel_calls(module) as counts:
            run(module, inputs_for(loader))
        assert counts == Counter({"self": 3})

    def test_declares_one_masked_self_site(self) -> None:
        """The kind declares site self with a mask, the pinned supported set and no default."""
        (site,) = TinyTextEncoderLoader.from_options({"heads": 2, "dim": 16}).sites()
        assert (site.name, site.role, site.heads, site.default) == (
            "self",
            AttentionRole.SELF,
            2,
            None,
        )
        assert site.requirements == AttentionRequirements(attention_mask=True)
        assert site.supported == frozenset({"torch_sdpa", "torch_flash", "reference", "flash_attn"})
        assert TinyTextEncoderLoader.allows_global_fallback

    def test_golden_output(self) -> None:
        """Seed 0 and the seeded example inputs give the recorded embeddings."""
        loader = loader_of("tiny_text_encoder")
        out = run(build_armed(loader), inputs_for(loader))
        assert_golden(out, GOLDEN["tiny_text_encoder"][0], GOLDEN["tiny_text_encoder"][1])

    def test_padding_does_not_leak_into_real_tokens(self) -> None:
        """Changing padded token ids leaves the embeddings of real tokens unchanged."""
        loader = loader_of("tiny_text_encoder")
        module = build_armed(loader)
        tokens, mask = inputs_for(loader, batch=3)
        other = tokens.masked_fill(~mask, 5)
        assert max_diff(module(tokens, mask)[mask], module(other, mask)[mask]) == 0.0

    def test_native_matches_custom(self) -> None:
        """The nn.TransformerEncoderLayer path shares the state dict and agrees on real tokens."""
        loader = loader_of("tiny_text_encoder", seed=5)
        custom, native = build_armed(loader), loader.build("native")
        assert not layers_of(native)
        assert same_state(custom.state_dict(), native.state_dict())
        tokens, mask = inputs_for(loader, batch=3)
        assert max_diff(custom(tokens, mask)[mask], native(tokens, mask)[mask]) <= 1e-5

    def test_explicit_backend_in_the_orchestrator_scope(self, cpu: Platform) -> None:
        """Built in its scope with an explicit torch_flash, every layer takes it as planned."""
        loader = loader_of("tiny_text_encoder")
        requests = ComponentRequests(
            component="text_encoder",
            component_backend=explicit("torch_flash"),
            allow_global_fallback=loader.allows_global_fallback,
        )
        with component_attention_scope(
            requests, plan=plan_for(loader, requests, cpu), platform=cpu
        ) as scope:
            module = loader.build("custom")
        assert [(r.site, r.selection.backend) for r in scope.records] == [
            ("self", "torch_flash"),
            ("self", "torch_flash"),
        ]
        arm_layers(module)
        assert torch.isfinite(run(module, inputs_for(loader))).all()

    def test_heads_must_divide_dim(self) -> None:
        """Heads that do not divide the width are refused when the options are decoded."""
        with pytest.raises(msgspec.ValidationError) as err:
            TinyTextEncoderLoader.from_options({"dim": 30, "heads": 4})
        assert str(err.value) == "heads = 4 must divide dim = 30; change one of them"

    def test_bad_value_is_refused(self) -> None:
        """A value out of its range is refused at its key."""
        with pytest.raises(msgspec.ValidationError) as err:
            TinyTextEncoderLoader.from_options({"layers": 0})
        assert str(err.value) == "Expected `int` >= 1 - at `$.layers`"


class TestTinyDit:
    """``tiny_dit``: latent tokens, timesteps and text embeddings to a prediction."""

    def test_output_shapes_and_finite(self) -> None:
        """Each request's prediction has the shape of its latents and is finite."""
        loader = loader_of("tiny_dit")
        latents, timesteps, context = inputs_for(loader, batch=3)
        outs = build_armed(loader)(latents, timesteps, context)
        assert [o.shape for o in outs] == [x.shape for x in latents]
        assert len({x.shape[0] for x in latents}) == 3
        assert all(torch.isfinite(o).all() for o in outs)

    def test_packed_run_calls_varlen_once_per_block(self) -> None:
        """Packed: self-attention runs once per block for all requests, cross once per request."""
        loader = loader_of("tiny_dit", layers=3)
        module = build_armed(loader)
        with kernel_calls(module) as counts:
            run(module, inputs_for(loader, batch=4))
        assert counts == Counter({"self": 3, "cross": 3 * 4})

    def test_unpacked_run_calls_each_site_per_request(self) -> None:
        """Unpacked: both sites run once per block and request, dense."""
        loader = loader_of("tiny_dit", layers=3, packed_sequences=False)
        module = build_armed(loader)
        with kernel_calls(module) as counts:
            run(module, inputs_for(loader, batch=4))
        assert counts == Counter({"self": 3 * 4, "cross": 3 * 4})

    def test_declares_strict_self_and_cross_sites(self) -> None:
        """The kind declares a varlen self site and a plain cross site, and is strict."""
        self_site, cross_site = TinyDitLoader.from_options({}).sites()
        assert (self_site.name, self_site.role) == ("self", AttentionRole.SELF)
        assert self_site.requirements == AttentionRequirements(packed_varlen=True)
        assert (cross_site.name, cross_site.role) == ("cross", AttentionRole.CROSS)
        assert cross_site.requirements == AttentionRequirements()
        for site in (self_site, cross_site):
            assert (site.supported, site.default) == (None, None)
        assert not TinyDitLoader.allows_global_fallback
        assert TinyDitLoader.sequence_parallel

    def test_unpacked_declares_no_varlen(self) -> None:
        """With packed_sequences false the self site requires nothing."""
        self_site, _ = TinyDitLoader.from_options({"packed_sequences": False}).sites()
        assert self_site.requirements == AttentionRequirements()

    def test_golden_output(self) -> None:
        """Seed 0 and the seeded example inputs give the recorded prediction."""
        loader = loader_of("tiny_dit")
        out = run(build_armed(loader), inputs_for(loader))
        assert_golden(out, GOLDEN["tiny_dit"][0], GOLDEN["tiny_dit"][1])

    def test_packed_equals_each_request_alone(self) -> None:
        """Packing requests of different sizes gives what running each alone gives."""
        loader = loader_of("tiny_dit")
        module = build_armed(loader)
        latents, timesteps, context = inputs_for(loader, batch=3)
        packed = module(latents, timesteps, context)
        for i, out in enumerate(packed):
            (alone,) = module([latents[i]], timesteps[i : i + 1], [context[i]])
            assert max_diff(out, alone) <= 1e-5

    def test_packed_equals_unpacked(self) -> None:
        """The packed and the one-request-at-a-time custom paths agree for one seed."""
        packed = build_armed(loader_of("tiny_dit", seed=2))
        unpacked = build_armed(loader_of("tiny_dit", seed=2, packed_sequences=False))
        inputs = inputs_for(loader_of("tiny_dit"), batch=3)
        assert max_diff(run(packed, inputs), run(unpacked, inputs)) <= 1e-5

    @pytest.mark.parametrize("context_dim", [32, 24])
    def test_native_matches_custom(self, context_dim: int) -> None:
        """The nn.MultiheadAttention path shares the state dict and agrees, packed or not."""
        loader = loader_of("tiny_dit", seed=4, context_dim=context_dim)
        custom, native = build_armed(loader), loader.build("native")
        assert not layers_of(native)
        assert same_state(custom.state_dict(), native.state_dict())
        inputs = inputs_for(loader, batch=3)
        assert max_diff(run(custom, inputs), run(native, inputs)) <= 1e-5

    def test_built_in_the_orchestrator_scope(self, cpu: Platform) -> None:
        """In its scope with its plan, self takes a varlen fallback and cross the default."""
        loader = loader_of("tiny_dit")
        requests = ComponentRequests(
            component="transformer", allow_global_fallback=loader.allows_global_fallback
        )
        with component_attention_scope(
            requests, plan=plan_for(loader, requests, cpu), platform=cpu
        ) as scope:
            module = loader.build("custom")
        chosen = {(r.site, r.selection.backend, r.selection.reason) for r in scope.records}
        assert chosen == {
            ("self", "torch_flash", PLATFORM_DEFAULT_FALLBACK),
            ("cross", "torch_sdpa", None),
        }
        arm_layers(module)
        assert torch.isfinite(run(module, inputs_for(loader))).all()

    def test_packed_refuses_an_explicit_dense_backend(self, cpu: Platform) -> None:
        """An explicit torch_sdpa cannot serve the packed self site: construction is refused."""
        loader = loader_of("tiny_dit")
        with (
            pytest.raises(BackendSelectionError) as err,
            component_attention_scope(
                ComponentRequests(
                    component="transformer", component_backend=explicit("torch_sdpa")
                ),
                platform=cpu,
            ),
        ):
            loader.build("custom")
        assert err.value.code == "attention.capability_missing"

    def test_unpacked_runs_on_an_explicit_dense_backend(self, cpu: Platform) -> None:
        """Without packing, an explicit torch_sdpa serves both sites."""
        loader = loader_of("tiny_dit", packed_sequences=False)
        with component_attention_scope(
            ComponentRequests(component="transformer", component_backend=explicit("torch_sdpa")),
            platform=cpu,
        ) as scope:
            module = loader.build("custom")
        assert {r.selection.backend for r in scope.records} == {"torch_sdpa"}
        arm_layers(module)
        assert torch.isfinite(run(module, inputs_for(loader))).all()

    def test_context_dim_defaults_to_the_text_encoders_width(self) -> None:
        """The DiT's default context width is the text encoder's default width."""
        dit = TinyDitLoader.from_options({}).options
        assert dit.context_dim == TinyTextEncoderLoader.from_options({}).options.dim

    def test_request_counts_must_agree(self) -> None:
        """Latents, timesteps and contexts of different lengths are refused with the numbers."""
        loader = loader_of("tiny_dit")
        latents, timesteps, context = inputs_for(loader, batch=2)
        with pytest.raises(ValueError, match="got 2 latents, 2 timesteps and 1 contexts"):
            build_armed(loader)(latents, timesteps, context[:1])

    def test_bad_value_is_refused(self) -> None:
        """A non-boolean packed_sequences and an odd width are refused at their keys."""
        with pytest.raises(msgspec.ValidationError) as err:
            TinyDitLoader.from_options({"packed_sequences": "yes"})
        assert str(err.value) == "Expected `bool`, got `str` - at `$.packed_sequences`"
        with pytest.raises(msgspec.ValidationError) as err:
            TinyDitLoader.from_options({"dim": 33})
        assert str(err.value) == "Expected `int` that's a multiple of 2 - at `$.dim`"


class TestTinyVae:
    """``tiny_vae``: latents to images through one mid-block attention."""

    def test_output_shape_and_range(self) -> None:
        """Latents (B, C, h, w) decode to finite images (B, 3, 4h, 4w) in [-1, 1]."""
        loader = loader_of("tiny_vae", latent_channels=3)
        (latents,) = inputs_for(loader, batch=2)
        out = build_armed(loader)(latents[:, :, :3, :])
        assert out.shape == (2, 3, 12, 16)
        assert torch.isfinite(out).all()
        assert out.abs().max() <= 1.0

    def test_mid_attention_runs_once(self) -> None:
        """One forward runs the mid site's kernel exactly once."""
        loader = loader_of("tiny_vae", heads=4)
        module = build_armed(loader)
        with kernel_calls(module) as counts:
            run(module, inputs_for(loader))
        assert counts == Counter({"mid": 1})

    def test_declares_the_mid_site(self) -> None:
        """The kind declares site mid: dense kernels only, torch_sdpa by default, no native path."""
        (site,) = TinyVaeLoader.from_options({}).sites()
        assert (site.name, site.role, site.default) == ("mid", AttentionRole.SELF, "torch_sdpa")
        assert site.supported == frozenset({"torch_sdpa", "torch_flash"})
        assert site.requirements == AttentionRequirements()
        assert TinyVaeLoader.allows_global_fallback
        assert not TinyVaeLoader.has_path("native")

    def test_golden_output(self) -> None:
        """Seed 0 and the seeded example latents give the recorded image."""
        loader = loader_of("tiny_vae")
        out = run(build_armed(loader), inputs_for(loader))
        assert_golden(out, GOLDEN["tiny_vae"][0], GOLDEN["tiny_vae"][1])

    def test_explicit_global_backend_falls_back(self, cpu: Platform) -> None:
        """An explicit global backend outside the supported set falls back to the default."""
        loader = loader_of("tiny_vae")
        requests = ComponentRequests(
            component="vae",
            global_backend=explicit("reference"),
            allow_global_fallback=loader.allows_global_fallback,
        )
        with component_attention_scope(
            requests, plan=plan_for(loader, requests, cpu), platform=cpu
        ) as scope:
            loader.build("custom")
        (record,) = scope.records
        assert (record.selection.backend, record.selection.reason) == (
            "torch_sdpa",
            GLOBAL_BACKEND_FALLBACK,
        )

    def test_groups_must_divide_channels(self) -> None:
        """GroupNorm groups that do not divide the width are refused with both numbers."""
        with pytest.raises(msgspec.ValidationError) as err:
            TinyVaeLoader.from_options({"groups": 5})
        assert str(err.value) == "groups = 5 must divide channels = 32; change one of them"


class TestTinyUpsampler:
    """``tiny_upsampler``: convolutions only, images to twice their size."""

    def test_output_shape_and_range(self) -> None:
        """Images (B, 3, H, W) become finite images (B, 3, 2H, 2W) in [-1, 1]."""
        loader = loader_of("tiny_upsampler")
        (images,) = inputs_for(loader, batch=2)
        out = build_armed(loader)(images[..., :6])
        assert out.shape == (2, 3, 16, 12)
        assert torch.isfinite(out).all()
        assert out.abs().max() <= 1.0

    def test_declares_and_builds_no_attention(self, cpu: Platform) -> None:
        """The kind declares no site, builds no layer, records nothing in its scope."""
        loader = loader_of("tiny_upsampler")
        assert loader.sites() == ()
        with component_attention_scope(
            ComponentRequests(component="upsampler"), plan={}, platform=cpu
        ) as scope:
            module = loader.build("custom")
        assert scope.records == ()
        assert not layers_of(module)
        assert not TinyUpsamplerLoader.has_path("native")

    def test_golden_output(self) -> None:
        """Seed 0 and the seeded example images give the recorded upsampled image."""
        loader = loader_of("tiny_upsampler")
        out = run(build_armed(loader), inputs_for(loader))
        assert_golden(out, GOLDEN["tiny_upsampler"][0], GOLDEN["tiny_upsampler"][1])

    def test_bad_value_is_refused(self) -> None:
        """A width below one is refused at its key."""
        with pytest.raises(msgspec.ValidationError) as err:
            TinyUpsamplerLoader.from_options({"channels": 0})
        assert str(err.value) == "Expected `int` >= 1 - at `$.channels`"


# Recorded with seed 0, default options, batch 2 of the example inputs (generator seed 1234):
# the output's sum and its first four elements.
GOLDEN: dict[str, tuple[float, list[float]]] = {
    "tiny_text_encoder": (4.677366, [-0.648297, 1.387053, -0.357048, 0.453755]),
    "tiny_dit": (10.653115, [1.107001, 0.284381, -0.9218, -1.073947]),
    "tiny_vae": (-21.562748, [0.135137, -0.162837, -0.053238, -0.049527]),
    "tiny_upsampler": (26.306374, [-0.853728, -1.0, -0.094579, -0.270198]),
}
