"""Recipes: how each supported diffusers pipeline class runs on the project's components."""

from __future__ import annotations

from components.recipes.base import Recipe
from components.recipes.flux import FluxRecipe
from components.recipes.pixart import PixArtAlphaRecipe, PixArtSigmaRecipe
from components.recipes.sd3 import Sd3Recipe

RECIPES: dict[str, type[Recipe]] = {
    recipe.pipeline_class: recipe
    for recipe in (PixArtAlphaRecipe, PixArtSigmaRecipe, FluxRecipe, Sd3Recipe)
}
"""The recipe of every supported pipeline class, by class name."""

__all__ = ["RECIPES", "Recipe"]
