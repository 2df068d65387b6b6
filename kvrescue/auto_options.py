"""The options given as `auto` that the models decide, resolved from the grid's plan (`cell_plan.GroupPlan`: its
models and which roles its cells run where) before the cells run: the prompt style from the policy model's family,
the PRM's recipe from its checkpoint's head weights (else its name and config)."""

from __future__ import annotations

from kvrescue.cell_plan import GroupPlan
from kvrescue.engine.prm_recipes import get_recipe
from kvrescue.engine.prm_recipes.choose import auto_recipe, weight_names
from kvrescue.errors import InputError
from kvrescue.model_config import ModelConfigError, load_config
from kvrescue.prm_catalogue import PRM_RECIPES
from kvrescue.prompts import resolve_style
from kvrescue.run_options import AUTO
from kvrescue.scorers import HELPER_LOGLIK, PRM


def resolve_prompt(group: GroupPlan) -> str:
    """The prompt style: `--prompt` as given, or `auto` resolved from the policy model (the base of any cell that
    samples one, else the helper) and its config."""
    models = group.models
    if models.prompt != AUTO:
        return models.prompt
    model = models.models["base" if any(cell.policy_role == "base" for cell in group.cells) else "helper"]
    try:
        model_type = load_config(model).get("model_type")
    except ModelConfigError:  # a GGUF file, or offline: the model's name decides
        model_type = None
    return resolve_style(AUTO, model, model_type)


def resolve_prm_recipe(group: GroupPlan) -> str:
    """The PRM's recipe: `--prm-recipe` as given, or `auto` resolved from the PRM checkpoint; one-line errors for a
    PRM no recipe fits and for a recipe the cells cannot serve where they run it (vLLM)."""
    options = group.models
    if options.scorer != PRM:
        return options.prm_recipe
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
    if recipe.no_vllm and "prm" in group.vllm_models():
        raise InputError(f"--engine vllm: {recipe.no_vllm}")
    return name
