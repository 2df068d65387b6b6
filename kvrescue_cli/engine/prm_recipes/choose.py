"""Which recipe a run's PRM takes: `--prm-recipe NAME`, or `auto` from the checkpoint where it is unambiguous (its
head weights, its name), and the one-line errors where none is or its engine cannot serve it."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvrescue_cli.engine.loader import ModelLoadError, tensor_names
from kvrescue_cli.engine.prm_recipes import PRM_RECIPES, get_recipe
from kvrescue_cli.errors import InputError
from kvrescue_cli.model_config import is_hub_id

if TYPE_CHECKING:
    from kvrescue_cli.grid import GridOptions

AUTO = "auto"


# Fragments of a checkpoint's name (its Hub id, its folder's or file's name, or the `_name_or_path` of its config)
# that say which recipe it takes, each recipe's published checkpoints: where neither its head weights nor its name
# say, an LM head of Llama or Mistral is any language model, and `--prm-recipe` decides.
NAMED = {
    "skywork": ("skywork-o1-open-prm",),
    "qwen-math": ("math-prm",),
    "math-shepherd": ("math-shepherd",),
    "rlhflow": ("rlhflow", "llama3.1-8b-prm-"),
}


def weight_names(model: str) -> set[str]:
    """The tensor names of a local checkpoint folder (the loader's reading of its safetensors headers); none for a
    Hub id, a GGUF file or weights that cannot be read (the loader says what is wrong with them)."""
    if not Path(model).expanduser().is_dir():
        return set()
    try:
        return tensor_names(model)
    except ModelLoadError:
        return set()


def checkpoint_names(model: str, cfg: dict[str, Any]) -> list[str]:
    """What names a checkpoint, lowered: a Hub id whole, a local path's last part (not the folders above it), and
    the `_name_or_path` its config records."""
    path = Path(model).expanduser()
    names = [model if is_hub_id(model) and not path.exists() else path.name]
    if isinstance(cfg.get("_name_or_path"), str):
        names.append(cfg["_name_or_path"])
    return [name.lower() for name in names]


def auto_recipe(model: str, cfg: dict[str, Any], names: set[str]) -> str | None:
    """The recipe a checkpoint's head weights, config and name point to, or None: a value head is Skywork's, a
    score.0/score.2 head (Qwen2ForProcessRewardModel) Qwen2.5-Math-PRM's; an LM head's recipe is the one its name
    says (`NAMED`). With no config (a Hub id offline, a GGUF file) and no name that says, Qwen2.5-Math-PRM's, the
    default: the loader then says what is wrong with it."""
    architectures = cfg.get("architectures") or []
    if "v_head.summary.weight" in names:
        return "skywork"
    if "score.0.weight" in names or any("ProcessRewardModel" in str(a) for a in architectures):
        return "qwen-math"
    called = checkpoint_names(model, cfg)
    named = [recipe for recipe, parts in NAMED.items() if any(part in name for part in parts for name in called)]
    if named:
        return named[0]
    return None if cfg else "qwen-math"


def resolve_prm_recipe(options: GridOptions) -> GridOptions:
    """`options` with `--prm-recipe auto` resolved from the PRM checkpoint; one-line errors for a PRM no recipe fits
    and for a recipe `--engine vllm` cannot serve."""
    if options.scorer != "prm":
        return options
    name = options.prm_recipe
    if name == AUTO:
        from kvrescue_cli.model_config import ModelConfigError, load_config

        model = options.models["prm"]
        try:
            cfg = load_config(model)
        except ModelConfigError:  # a GGUF file, or offline: the weights and the name decide
            cfg = {}
        name = auto_recipe(model, cfg, weight_names(model))
        if name is None:
            raise InputError(f"--prm {model} has no PRM head (score.0/score.2 or v_head.summary weights) and neither "
                             f"its name nor its config says which PRM it is (a {cfg.get('model_type')} model): give "
                             f"--prm-recipe, one of {', '.join(PRM_RECIPES)}, or --prm helper-loglik for the named "
                             "alternative scorer")
    recipe = get_recipe(name, options.prm_format)
    if recipe.no_vllm and "prm" in options.vllm_roles():
        raise InputError(f"--engine vllm: {recipe.no_vllm}")
    return replace(options, prm_recipe=name)
