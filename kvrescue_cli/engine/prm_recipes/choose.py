"""Which recipe a run's PRM takes: `--prm-recipe NAME`, or `auto` from the checkpoint (its head weights, its
architecture, its name), and the one-line errors where none fits or its engine cannot serve it."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvrescue_cli.engine.prm_recipes import PRM_RECIPES, get_recipe
from kvrescue_cli.errors import InputError

if TYPE_CHECKING:
    from kvrescue_cli.grid import GridOptions

AUTO = "auto"


def weight_names(model: str) -> set[str]:
    """The tensor names of a local folder's safetensors files (from their index, else their headers); none for a Hub
    id or a file that cannot be read (the loader says what is wrong with it)."""
    folder = Path(model).expanduser()
    if not folder.is_dir():
        return set()
    names: set[str] = set()
    try:
        for index in folder.glob("*.safetensors.index.json"):
            names |= set(json.loads(index.read_text()).get("weight_map", {}))
        if not names:
            for weights in folder.glob("*.safetensors"):
                with open(weights, "rb") as f:
                    size = int.from_bytes(f.read(8), "little")
                    names |= set(json.loads(f.read(min(size, 100 << 20))))
    except (OSError, ValueError, AttributeError):
        return set()
    return names - {"__metadata__"}


def auto_recipe(model: str, cfg: dict[str, Any], names: set[str]) -> str | None:
    """The recipe a checkpoint's head weights, config and name point to, or None: a value head is Skywork's, a
    score.0/score.2 head (Qwen2ForProcessRewardModel) Qwen2.5-Math-PRM's; an LM head's recipe is the one of its
    architecture (Mistral: Math-Shepherd, Llama: RLHFlow) or of its name. With no config (a Hub id offline, a GGUF
    file) and no name that says, Qwen2.5-Math-PRM's, the default: the loader then says what is wrong with it."""
    lowered = model.lower()
    architectures = cfg.get("architectures") or []
    if "v_head.summary.weight" in names or ("skywork" in lowered and "prm" in lowered):
        return "skywork"
    if "score.0.weight" in names or any("ProcessRewardModel" in str(a) for a in architectures) or "math-prm" in lowered:
        return "qwen-math"
    if "math-shepherd" in lowered or cfg.get("model_type") == "mistral":
        return "math-shepherd"
    if "rlhflow" in lowered or cfg.get("model_type") == "llama":
        return "rlhflow"
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
            raise InputError(f"--prm {model} has no PRM head (score.0/score.2 or v_head.summary weights) and no PRM "
                             f"recipe is known for its architecture ({cfg.get('model_type')}): give --prm-recipe, one "
                             f"of {', '.join(PRM_RECIPES)}, or --prm helper-loglik for the named alternative scorer")
    recipe = get_recipe(name, options.prm_format)
    if recipe.no_vllm and "prm" in options.vllm_roles():
        raise InputError(f"--engine vllm: {recipe.no_vllm}")
    return replace(options, prm_recipe=name)
