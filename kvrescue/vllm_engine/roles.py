"""The vLLM engines of a run with `--engine vllm`: one per model its roles name (base and helper share one when
they name the same model; the PRM's runs vLLM's pooling runner), started once and kept for every cell."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from kvrescue.engine.loader import ModelLoadError, load_tokenizer, model_folder
from kvrescue.engine.prm_recipes import PRMRecipe
from kvrescue.errors import InputError
from kvrescue.shapes import PRM_WINDOW
from kvrescue.vllm_engine import require_vllm
from kvrescue.vllm_engine.llm import start_llm
from kvrescue.vllm_engine.prm import VLLMPRMScorer, pooling_args
from kvrescue.vllm_engine.steps import SteppedEngine, VllmRunner

BATCH_INVARIANT = "VLLM_BATCH_INVARIANT"  # vLLM's switch: batch-invariant kernels and reductions on its GPU workers


@dataclass(frozen=True)
class EngineSpec:
    """One vLLM engine: its model (as given), the roles it serves, and the longest input it takes."""

    model: str
    roles: tuple[str, ...]
    max_model_len: int

    @property
    def pooling(self) -> bool:
        return self.roles == ("prm",)


def engine_specs(models: dict[str, str], context_cap: int) -> list[EngineSpec]:
    """The vLLM engines of the roles `models` names (role -> model): one generating engine per model of the
    base/helper roles, taking contexts up to `context_cap`, and one for the PRM."""
    by_model: dict[str, list[str]] = {}
    for role in sorted(set(models) - {"prm"}):
        by_model.setdefault(models[role], []).append(role)
    specs = [EngineSpec(model, tuple(served), context_cap) for model, served in by_model.items()]
    return specs + ([EngineSpec(models["prm"], ("prm",), PRM_WINDOW)] if "prm" in models else [])


class VllmEngines:
    """The started engines: a `VllmRunner` per cell for the base/helper roles, a `VLLMPRMScorer` for the PRM."""

    def __init__(self, specs: list[EngineSpec], dtype: str, recipe: PRMRecipe, memory: list[dict[str, Any]],
                 batch_invariant: bool = False) -> None:
        """`memory`: each engine's share of the device as `start_llm` takes it (device_plan.vllm_memory), in
        `specs` order; `recipe`: the PRM's input recipe (engine/prm_recipes); `batch_invariant`: vLLM's
        batch-invariant mode (`--deterministic`)."""
        if batch_invariant:
            os.environ[BATCH_INVARIANT] = "1"  # read by vLLM's envs.py in this process and its engine cores
        self.version = require_vllm().__version__
        self.recipe = recipe
        self.engines: list[SteppedEngine | Any] = []
        self.steppers: dict[str, SteppedEngine] = {}
        self.tokenizers: dict[str, tuple[Any, list[int]]] = {}  # role -> (tokenizer, EOS ids), read once per engine
        self.prm = None
        try:
            for spec, share in zip(specs, memory):
                self._start(spec, dtype, share)
        except BaseException:
            self.close()
            raise

    def _start(self, spec: EngineSpec, dtype: str, share: dict[str, Any]) -> None:
        what = f"{'/'.join(spec.roles)} model {spec.model}"
        try:
            folder = model_folder(spec.model)
            tokenizer_and_eos = load_tokenizer(spec.model)
            head = pooling_args(self.recipe, tokenizer_and_eos[0], spec.model) if spec.pooling else {}
        except (ModelLoadError, ValueError) as err:
            raise InputError(f"{'/'.join(spec.roles)} model: {err}") from None
        try:
            llm = start_llm(folder, dtype=dtype, max_model_len=spec.max_model_len,
                            runner="pooling" if spec.pooling else "generate", enable_prefix_caching=True, **share,
                            **head)
        except Exception as err:  # vLLM's own reasons are in its log lines above; keep ours to one line
            raise InputError(f"vLLM could not start the {what}: {type(err).__name__}: "
                             f"{str(err).splitlines()[0] if str(err) else ''}") from None
        self.tokenizers.update(dict.fromkeys(spec.roles, tokenizer_and_eos))
        if spec.pooling:
            self.prm = llm
            self.engines.append(llm)
            return
        stepped = SteppedEngine(llm.llm_engine)
        self.engines.append(stepped)
        self.steppers.update(dict.fromkeys(spec.roles, stepped))

    def runner(self, role: str) -> VllmRunner:
        """A fresh runner (no rows) of `role` for one cell."""
        return VllmRunner(self.steppers[role], self.tokenizers[role][0])

    def scorer(self) -> VLLMPRMScorer:
        """The PRM scorer for one cell (the PRM's tokenizer read once, when its engine started)."""
        return VLLMPRMScorer(self.prm, self.tokenizers["prm"][0], recipe=self.recipe)

    def close(self) -> None:
        """Shut every engine's processes down."""
        for engine in self.engines:
            if isinstance(engine, SteppedEngine):
                engine.close()
            else:
                engine.llm_engine.engine_core.shutdown()
        self.engines = []
