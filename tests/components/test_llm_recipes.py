"""Recipes whose text encoder is a language model (Qwen-Image, Z-Image, Flux.2 klein)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from benchmarks._llm_folders import QWEN_IMAGE_TEMPLATE
from components.batch import Batch
from components.kinds.llm_text_encoder import LlmTextEncoderLoader
from components.offload.base import StoreOptions
from components.offload.factory import make_store
from components.recipes.qwen_image import DROPPED, TEMPLATE
from components.residency import ResidencyMode
from tests.components.folder_runs import (
    Loaded,
    Request,
    batch_of,
    load,
    run_diffusers,
    run_recipe,
)
from tests.conftest import PipelineFolders

pytestmark = pytest.mark.usefixtures("one_thread")

TOLERANCE = 1e-5
"""Largest absolute pixel difference (images in [0, 1], float32, CPU) the issue allows."""
BFLOAT16_TOLERANCE = 3e-2
"""The same in bfloat16 (design §12)."""

CASES = {
    # 3.0, not diffusers' default true_cfg_scale of 4.0: the scale must reach it
    "qwen-image": Request(negative_prompt="a grey dog", guidance_scale=3.0, count=2),
    "z-image": Request(negative_prompt="a grey dog", size=(64, 32), seed=3),
    "flux2-klein": Request(guidance_scale=3.0, count=2, seed=1),
    "flux2-klein-distilled": Request(guidance_scale=1.0, size=(32, 32), seed=2),
}
"""One guided request per family (the distilled klein never guides)."""
UNGUIDED = {
    "qwen-image": Request(guidance_scale=1.0, size=(64, 32)),
    "z-image": Request(guidance_scale=0.0, count=2),
    "flux2-klein": Request(guidance_scale=1.0),
}
"""One request per family that runs one branch: each class's own way of turning guidance off."""


@pytest.fixture(scope="module")
def loaded(pipeline_folder: PipelineFolders) -> dict[str, Loaded]:
    """Every family's recipe with its components built natively, once per module."""
    return {family: load(pipeline_folder(family)) for family in CASES}


@pytest.fixture(scope="module")
def case_images(loaded: dict[str, Loaded]) -> dict[str, torch.Tensor]:
    """Each family's image of its ``CASES`` request through the recipe, made once for the
    tests that compare it with diffusers' and with another request's."""
    torch.set_num_threads(1)  # the module's first test is under one_thread too
    return {family: run_recipe(loaded[family], request) for family, request in CASES.items()}


class TestEqualToDiffusers:
    """Each class makes diffusers' images from the same folder and request."""

    @pytest.mark.parametrize("family", list(CASES))
    def test_guided_images_equal_diffusers(
        self,
        family: str,
        case_images: dict[str, torch.Tensor],
        pipeline_folder: PipelineFolders,
    ) -> None:
        """Prompt, negative prompt, seed, steps, guidance, size, count: as diffusers reads them."""
        request = CASES[family]
        ours = case_images[family]
        theirs = run_diffusers(pipeline_folder(family), request)
        assert ours.shape == theirs.shape == (request.count, 3, *request.size)
        assert (ours - theirs).abs().max() <= TOLERANCE

    @pytest.mark.parametrize("family", list(UNGUIDED))
    def test_unguided_images_equal_diffusers(
        self, family: str, loaded: dict[str, Loaded], pipeline_folder: PipelineFolders
    ) -> None:
        """Guidance off (Qwen-Image: scale 1; Z-Image: 0; klein: 1) runs one branch, as there."""
        request = UNGUIDED[family]
        ours = run_recipe(loaded[family], request)
        assert (ours - run_diffusers(pipeline_folder(family), request)).abs().max() <= TOLERANCE

    @pytest.mark.parametrize("family", ["qwen-image", "z-image", "flux2-klein"])
    def test_bfloat16_within_tolerance(self, family: str, pipeline_folder: PipelineFolders) -> None:
        """In bfloat16, loaded natively, the image is diffusers' in bfloat16 within 3e-2."""
        folder = pipeline_folder(family)
        request = CASES[family]._replace(count=1)
        ours = run_recipe(load(folder, torch.bfloat16), request).float()
        theirs = run_diffusers(folder, request, torch.bfloat16).float()
        assert (ours - theirs).abs().max() <= BFLOAT16_TOLERANCE


class TestPromptReachesTheImage:
    """The guard against a prompt silently dropped with the template: what it says and how
    strongly it guides both show in the image."""

    @pytest.mark.parametrize("family", list(CASES))
    def test_a_prompt_changes_the_image(
        self, family: str, loaded: dict[str, Loaded], case_images: dict[str, torch.Tensor]
    ) -> None:
        """Another prompt, all else equal, makes another image (distilled klein too)."""
        other = CASES[family]._replace(prompt="a blue whale swims in the deep sea at night")
        assert (case_images[family] - run_recipe(loaded[family], other)).abs().max() > 1e-3

    @pytest.mark.parametrize("family", list(UNGUIDED))
    def test_the_guidance_scale_changes_the_image(
        self, family: str, loaded: dict[str, Loaded], case_images: dict[str, torch.Tensor]
    ) -> None:
        """Another guidance scale, all else equal, makes another image (each guided class)."""
        request = CASES[family]
        other = request._replace(guidance_scale=request.guidance_scale + 2)
        assert (case_images[family] - run_recipe(loaded[family], other)).abs().max() > 1e-3


class TestTemplates:
    """Each recipe puts the prompt in its pipeline's template and keeps what diffusers keeps."""

    def test_qwen_image_drops_exactly_the_template_head(self, loaded: dict[str, Loaded]) -> None:
        """The template's head is 34 tokens of the folder's tokenizer, so what reaches the DiT
        is the prompt's tokens and the template's 5-token tail, nothing of the system prompt."""
        pipeline = loaded["qwen-image"]
        encoder = pipeline.loaders["text_encoder"]
        assert isinstance(encoder, LlmTextEncoderLoader)
        head = TEMPLATE.split("{}")[0]
        assert TEMPLATE == QWEN_IMAGE_TEMPLATE
        assert len(encoder.tokenizer(head).input_ids) == DROPPED
        prompt = "a red fox leaps over the snow"
        batch = batch_of(Request(prompt=prompt, guidance_scale=1.0))
        with torch.inference_mode():
            pipeline.recipe.run("encode", {"text_encoder": pipeline.modules["text_encoder"]}, batch)
        assert batch.context is not None
        tail = len(encoder.tokenizer("<|im_end|>\n<|im_start|>assistant\n").input_ids)
        assert tail == 5
        assert batch.context[0].shape[0] == len(encoder.tokenizer(prompt).input_ids) + tail

    @pytest.mark.parametrize(
        ("family", "thinking"), [("z-image", ""), ("flux2-klein", "<think>\n\n</think>\n\n")]
    )
    def test_chat_template_of_a_user_message(
        self, family: str, thinking: str, loaded: dict[str, Loaded]
    ) -> None:
        """Z-Image leaves thinking on (no block), Flux.2 klein turns it off (an empty block)."""
        encoder = loaded[family].loaders["text_encoder"]
        assert isinstance(encoder, LlmTextEncoderLoader)
        flags = {"enable_thinking": family == "z-image"}
        assert encoder.chat("a fox", **flags) == (
            f"<|im_start|>user\na fox<|im_end|>\n<|im_start|>assistant\n{thinking}"
        )


class TestRefused:
    """What diffusers' call would ignore is refused, with the fix."""

    @pytest.mark.parametrize(
        ("family", "request_", "message"),
        [
            (
                "qwen-image",
                Request(guidance_scale=4.0),
                "guides (true CFG) only against a negative prompt: guidance scale 4.0 would be",
            ),
            (
                "qwen-image",
                Request(guidance_scale=1.0, negative_prompt="a dog"),
                "guides against the negative prompt only at a guidance scale above 1: at 1.0",
            ),
            (
                "z-image",
                Request(guidance_scale=0.0, negative_prompt="a dog"),
                "guides against the negative prompt only at a guidance scale above 0",
            ),
            ("flux2-klein", Request(negative_prompt="a dog"), "takes no negative prompt"),
            (
                "flux2-klein-distilled",
                Request(guidance_scale=3.0),
                "is distilled (is_distilled in model_index.json): it runs no guidance",
            ),
        ],
    )
    def test_ignored_arguments_are_refused(
        self, family: str, request_: Request, message: str, loaded: dict[str, Loaded]
    ) -> None:
        """A guidance scale or negative prompt the class would drop silently is a ValueError."""
        with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
            loaded[family].recipe.check(batch_of(request_))

    def test_a_size_off_the_grid_names_the_multiple(self, loaded: dict[str, Loaded]) -> None:
        """diffusers resizes a size off the packing grid with a warning; here it is refused."""
        with pytest.raises(ValueError, match="must be multiples of 8"):
            loaded["qwen-image"].recipe.check(batch_of(Request(size=(36, 32), guidance_scale=1)))


READ = {"qwen-image": 2, "z-image": 1, "flux2-klein": 27}
"""The layers each tiny folder's encode runs: Qwen-Image reads the last state (both layers
run), Z-Image the last layer's input (one of two), klein layer 27's input (27 of 28)."""


def encode(pipeline: Loaded, request: Request) -> Batch:
    """Run the encode stage of ``request`` alone; return its batch."""
    batch = batch_of(request)
    with torch.inference_mode():
        pipeline.recipe.run("encode", {"text_encoder": pipeline.modules["text_encoder"]}, batch)
    return batch


def text_encoder(pipeline: Loaded) -> LlmTextEncoderLoader:
    """Return the pipeline's language model loader."""
    encoder = pipeline.loaders["text_encoder"]
    assert isinstance(encoder, LlmTextEncoderLoader)
    return encoder


class TestLayersRun:
    """The language model runs no layer past the deepest hidden state its pipeline reads."""

    @pytest.mark.parametrize("family", list(READ))
    def test_unread_layers_never_run(self, family: str, loaded: dict[str, Loaded]) -> None:
        """An encode calls the first layers up to the deepest state read, in order, and no
        other; every layer is still loaded."""
        pipeline = loaded[family]
        encoder = text_encoder(pipeline)
        layers = encoder.blocks(pipeline.modules["text_encoder"])
        assert layers is not None
        assert len(layers) == encoder.layers
        assert all(p.device.type == "cpu" for p in layers.parameters())
        ran: list[int] = []
        handles = [
            layer.register_forward_hook(lambda *_, i=i: ran.append(i))
            for i, layer in enumerate(layers)
        ]
        try:
            encode(pipeline, UNGUIDED[family])
        finally:
            for handle in handles:
                handle.remove()
        assert ran == list(range(READ[family])) == list(range(encoder.blocks_run()))

    @pytest.mark.parametrize("family", ["z-image", "flux2-klein"])
    def test_states_equal_diffusers_to_the_bit(
        self, family: str, loaded: dict[str, Loaded], pipeline_folder: PipelineFolders
    ) -> None:
        """The states of the model stopped early are diffusers' prompt embeddings to the bit,
        its text encoder running every layer."""
        from diffusers import DiffusionPipeline

        batch = encode(loaded[family], UNGUIDED[family])
        # the text encoder and tokenizer alone: what encode_prompt reads
        folder = str(pipeline_folder(family))
        theirs = DiffusionPipeline.from_pretrained(folder, transformer=None, vae=None)
        flags = {"do_classifier_free_guidance": False} if family == "z-image" else {}
        with torch.inference_mode():
            embeds = theirs.encode_prompt(batch.prompts, torch.device("cpu"), **flags)[0]
        assert batch.context is not None
        assert len(batch.context) == len(embeds) == UNGUIDED[family].count
        assert all(map(torch.equal, batch.context, embeds))

    @pytest.mark.parametrize("family", list(READ))
    def test_an_encode_calls_the_model_itself(self, family: str, loaded: dict[str, Loaded]) -> None:
        """Each encode calls the component's module once, so the hooks that a layerwise
        store and compilation put on it run; its head projects no token."""
        pipeline = loaded[family]
        module = pipeline.modules["text_encoder"]
        outputs: list[object] = []
        handle = module.register_forward_hook(lambda *args: outputs.append(args[-1]))
        try:
            encode(pipeline, UNGUIDED[family])
        finally:
            handle.remove()
        assert len(outputs) == 1
        logits = getattr(outputs[0], "logits", None)
        assert logits is None or logits.shape[1] == 0

    def test_layerwise_offload_fetches_no_unread_layer(self, loaded: dict[str, Loaded]) -> None:
        """Streamed block by block, the layer after the last that runs is never prefetched:
        once that one has run and left, only the non-block weights are on the device."""
        pipeline = loaded["flux2-klein"]
        encoder = text_encoder(pipeline)
        module = pipeline.modules["text_encoder"]
        layers = encoder.blocks(module)
        assert layers is not None
        options = StoreOptions(
            device=torch.device("cpu"),
            file=lambda: Path("unused"),
            blocks=layers,
            runs=encoder.blocks_run(),
        )
        store = make_store(module, ResidencyMode.LAYERWISE_OFFLOAD, "host", options, resident=True)
        before = store.resident_bytes()
        after_last: list[int] = []
        last = layers[encoder.blocks_run() - 1]
        handle = last.register_forward_hook(lambda *_: after_last.append(store.resident_bytes()))
        try:
            encode(pipeline, UNGUIDED["flux2-klein"])
        finally:
            handle.remove()
            store.close()
        assert after_last == [before]
