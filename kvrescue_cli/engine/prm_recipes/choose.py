"""Which recipe a PRM checkpoint takes under `--prm-recipe auto`: from its head weights, its architecture, its name
(`grid.resolve_prm_recipe` applies it to a run, with the one-line errors where none fits or vLLM cannot serve it)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


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
