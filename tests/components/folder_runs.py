"""Run a pipeline folder through its recipe on native modules, and through diffusers itself."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch import nn

from components.batch import Batch
from components.folders.loader import FolderLoader
from components.recipes import Recipe
from components.recipes.folder import FolderPipeline

KINDS = {
    "pixart": {
        "text_encoder": "t5_encoder",
        "transformer": "pixart_transformer",
        "vae": "autoencoder_kl",
    },
    "pixart-sigma": {
        "text_encoder": "t5_encoder",
        "transformer": "pixart_transformer",
        "vae": "autoencoder_kl",
    },
    "flux": {
        "text_encoder": "clip_text_encoder",
        "text_encoder_2": "t5_encoder",
        "transformer": "flux_transformer",
        "vae": "autoencoder_kl",
    },
    "sd3": {
        "text_encoder": "clip_text_encoder",
        "text_encoder_2": "clip_text_encoder",
        "text_encoder_3": "t5_encoder",
        "transformer": "sd3_transformer",
        "vae": "autoencoder_kl",
    },
    "qwen-image": {
        "text_encoder": "llm_text_encoder",
        "transformer": "qwen_image_transformer",
        "vae": "autoencoder_kl_qwen_image",
    },
    "z-image": {
        "text_encoder": "llm_text_encoder",
        "transformer": "z_image_transformer",
        "vae": "autoencoder_kl",
    },
    "flux2-klein": {
        "text_encoder": "llm_text_encoder",
        "transformer": "flux2_transformer",
        "vae": "autoencoder_kl_flux2",
    },
}
"""The kind of each component a folder of each family names in its index."""

PROMPT = "A red fox leaps over the snow at dawn"


class Request(NamedTuple):
    """One image request, in diffusers' terms."""

    prompt: str = PROMPT
    negative_prompt: str | None = None
    seed: int = 0
    steps: int = 2
    guidance_scale: float = 4.0
    size: tuple[int, int] = (32, 64)
    count: int = 1


class Loaded(NamedTuple):
    """A folder's recipe with its loaders and the modules they built natively."""

    recipe: Recipe
    loaders: dict[str, FolderLoader]
    modules: dict[str, nn.Module]


def load(folder: Path, dtype: torch.dtype = torch.float32) -> Loaded:
    """Read ``folder`` and build each component natively in ``dtype``."""
    pipeline = FolderPipeline.read(folder)
    assert not pipeline.problems, pipeline.problems
    assert pipeline.recipe is not None
    loaders: dict[str, FolderLoader] = {}
    for name, loader in pipeline.loaders().items():
        assert isinstance(loader, FolderLoader)
        loader.dtype = dtype
        loaders[name] = loader
    recipe = pipeline.recipe(pipeline.model_index, loaders)
    return Loaded(recipe, loaders, {name: each.build("native") for name, each in loaders.items()})


def recipe_of(folder: Path) -> Recipe:
    """Return the recipe of ``folder`` without building any module."""
    pipeline = FolderPipeline.read(folder)
    assert pipeline.recipe is not None
    return pipeline.recipe(pipeline.model_index, pipeline.loaders())


def batch_of(request: Request) -> Batch:
    """Return the ``Batch`` of ``request``, seeded as diffusers seeds its generator."""
    return Batch(
        generator=torch.Generator("cpu").manual_seed(request.seed),
        steps=request.steps,
        size=request.count,
        prompts=[request.prompt] * request.count,
        negative_prompts=None
        if request.negative_prompt is None
        else [request.negative_prompt] * request.count,
        guidance_scale=request.guidance_scale,
        image_size=request.size,
    )


def run_recipe(
    loaded: Loaded,
    request: Request,
    around: Callable[[str, Mapping[str, nn.Module]], Any] | None = None,
) -> torch.Tensor:
    """Run every stage of the recipe on ``request``; return the images in [0, 1].

    ``around(stage, modules)`` may return a context manager each stage runs inside.
    """
    return run_batch(loaded, batch_of(request), around)


def run_batch(
    loaded: Loaded,
    batch: Batch,
    around: Callable[[str, Mapping[str, nn.Module]], Any] | None = None,
) -> torch.Tensor:
    """Run every stage of the recipe on ``batch`` (``around`` as ``run_recipe``'s); return
    the images in [0, 1]."""
    with torch.inference_mode():
        for stage in loaded.recipe.stages:
            modules = {name: loaded.modules[name] for name in stage.uses}
            if around is None:
                loaded.recipe.run(stage.name, modules, batch)
            else:
                with around(stage.name, modules):
                    loaded.recipe.run(stage.name, modules, batch)
    assert isinstance(batch.images, torch.Tensor)  # one size: one tensor
    return (batch.images / 2 + 0.5).clamp(0, 1)


def run_diffusers(
    folder: Path, request: Request, dtype: torch.dtype = torch.float32, **extra: Any
) -> torch.Tensor:
    """Run diffusers' own pipeline from ``folder`` in ``dtype`` on ``request``; the images
    in [0, 1] (``extra`` goes to the pipeline's call)."""
    from diffusers import DiffusionPipeline

    pipeline = DiffusionPipeline.from_pretrained(str(folder), torch_dtype=dtype)
    if request.negative_prompt is not None:
        extra["negative_prompt"] = request.negative_prompt
    return call_pipeline(pipeline, request, **extra)


def call_pipeline(pipeline: Any, request: Request, **extra: Any) -> torch.Tensor:
    """Call a diffusers pipeline on ``request`` (its seed, steps, guidance, size and count);
    the images in [0, 1] (``extra`` goes to the call).

    Qwen-Image's guidance scale is its ``true_cfg_scale`` (its ``guidance_scale`` is for a
    guidance-distilled DiT, which it does not have).
    """
    pipeline.set_progress_bar_config(disable=True)
    guidance = {"guidance_scale": request.guidance_scale}
    if type(pipeline).__name__ == "QwenImagePipeline":
        guidance = {"true_cfg_scale": request.guidance_scale}
    images: torch.Tensor = pipeline(
        prompt=request.prompt,  # by name: Flux.2 klein's first argument is an image
        generator=torch.Generator("cpu").manual_seed(request.seed),
        num_inference_steps=request.steps,
        **guidance,
        height=request.size[0],
        width=request.size[1],
        num_images_per_prompt=request.count,
        output_type="pt",
        **extra,
    ).images
    return images
