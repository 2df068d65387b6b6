"""The options given as `auto` that the models decide, resolved before any cell is planned: the prompt style from the
policy model's family, the PRM's recipe from its checkpoint's head weights (else its name and config)."""

from __future__ import annotations

from dataclasses import replace

from kvrescue.engine.prm_recipes import PRM_RECIPES, get_recipe
from kvrescue.engine.prm_recipes.choose import auto_recipe, weight_names
from kvrescue.errors import InputError
from kvrescue.grid import GridOptions
from kvrescue.methods import METHODS
from kvrescue.model_config import ModelConfigError, load_config
from kvrescue.prompts import resolve_style
from kvrescue.run_options import AUTO
from kvrescue.scorers import HELPER_LOGLIK, PRM


def resolve_prompt(options: GridOptions) -> GridOptions:
    """`options` with `--prompt auto` resolved from the policy model (the base, else the helper) and its config."""
    if options.prompt != AUTO:
        return options
    model = options.models["base" if any(METHODS[m].base for m in options.methods) else "helper"]
    try:
        model_type = load_config(model).get("model_type")
    except ModelConfigError:  # a GGUF file, or offline: the model's name decides
        model_type = None
    return replace(options, prompt=resolve_style(AUTO, model, model_type))


def resolve_prm_recipe(options: GridOptions) -> GridOptions:
    """`options` with `--prm-recipe auto` resolved from the PRM checkpoint; one-line errors for a PRM no recipe fits
    and for a recipe `--engine vllm` cannot serve."""
    if options.scorer != PRM:
        return options
    name = options.prm_recipe
    if name == AUTO:
        model = options.models["prm"]
        try:
            cfg = load_config(model)
        except ModelConfigError:  # a GGUF file, or offline: the weights and the name decide
            cfg = {}
        name = auto_recipe(model, cfg, weight_names(model))
        if name is None:
            raise InputError(f"--prm {model} has no PRM head (score.0/score.2 or v_head.summary weights) and neither "
                             f"its name nor its config says which PRM it is (a {cfg.get('model_type')} model): give "
                             f"--prm-recipe, one of {', '.join(PRM_RECIPES)}, or --prm {HELPER_LOGLIK} for the named "
                             "alternative scorer")
    recipe = get_recipe(name, options.prm_format)
    if recipe.no_vllm and "prm" in options.group_plan().vllm_models():
        raise InputError(f"--engine vllm: {recipe.no_vllm}")
    return replace(options, prm_recipe=name)
