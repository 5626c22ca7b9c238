"""Recipes: how each supported diffusers pipeline class runs on the project's components."""

from __future__ import annotations

from components.recipes.base import Recipe
from components.recipes.flux import FluxRecipe
from components.recipes.flux2_klein import Flux2KleinRecipe
from components.recipes.pixart import PixArtAlphaRecipe, PixArtSigmaRecipe
from components.recipes.qwen_image import QwenImageRecipe
from components.recipes.sd3 import Sd3Recipe
from components.recipes.wan import WanRecipe
from components.recipes.wan_i2v import WanImageToVideoRecipe
from components.recipes.z_image import ZImageRecipe

RECIPES: dict[str, type[Recipe]] = {
    recipe.pipeline_class: recipe
    for recipe in (
        PixArtAlphaRecipe,
        PixArtSigmaRecipe,
        FluxRecipe,
        Sd3Recipe,
        QwenImageRecipe,
        ZImageRecipe,
        Flux2KleinRecipe,
        WanRecipe,
        WanImageToVideoRecipe,
    )
}
"""The recipe of every supported pipeline class, by class name."""

__all__ = ["RECIPES", "Recipe"]
