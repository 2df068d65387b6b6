"""The registry of PRM recipes, one per file: `qwen_math` (its two `--prm-format`s), `rlhflow`, `math_shepherd`,
`skywork`, registered against the names of `kvrescue.prm_catalogue`; `choose` picks one for a checkpoint."""

from __future__ import annotations

from kvrescue.engine.prm_recipes.base import HEADS, PRMRecipe, RecipeInputs
from kvrescue.engine.prm_recipes.math_shepherd import MATH_SHEPHERD
from kvrescue.engine.prm_recipes.qwen_math import FORMATS
from kvrescue.engine.prm_recipes.rlhflow import RLHFLOW
from kvrescue.engine.prm_recipes.skywork import SKYWORK
from kvrescue.prm_catalogue import PRM_RECIPES

OTHERS = {r.name: r for r in (RLHFLOW, MATH_SHEPHERD, SKYWORK)}


def get_recipe(name: str, prm_format: str = "paper") -> PRMRecipe:
    """The recipe called `name` (qwen-math: in its `prm_format`); a ValueError naming the known ones."""
    if name == "qwen-math":
        return FORMATS[prm_format]
    if name not in OTHERS:
        raise ValueError(f"unknown PRM recipe {name!r}: use one of {', '.join(PRM_RECIPES)}")
    return OTHERS[name]


__all__ = ["FORMATS", "HEADS", "PRMRecipe", "RecipeInputs", "get_recipe"]
