"""Which recipe a PRM checkpoint takes under `--prm-recipe auto`: where it is unambiguous, from its head weights or
its name (`auto_options.resolve_prm_recipe` applies it to a run, with the one-line errors where none fits or vLLM
cannot serve it)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvrescue.engine.loader import ModelLoadError, tensor_names
from kvrescue.model_config import is_hub_id


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

