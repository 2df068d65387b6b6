"""What one cell runs where, decided once (`grid.GridOptions.cell_plan`): for each role the engine it runs on (this
one or vLLM) and its cache (bounded or full), the cell's settings and sizes, its prompt style, its scorer and its
graders; and what a device group loads for the grid's cells (`GroupPlan`, `grid.GridOptions.group_plan`).

Torch-free and free of the grid's options: `cell_runners.build_cell` builds the cell from it, `decoding.decode_cell`
decodes it, the memory planner plans it (`memory_plan.cell_shapes`), `group_models` and `device_plan` load and place
a group's models from the group's plan, and the run folder records it (`runs.cell_config`); none of them asks the
options these questions.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

from kvrescue.data import ProblemSet
from kvrescue.run_options import EngineOptions, GradingOptions, ModelOptions, Placement
from kvrescue.scorers import PRM

if TYPE_CHECKING:  # the controller's settings travel in the plan; the controller (and torch) is not loaded here
    from kvrescue.search import SearchSettings

NATIVE, VLLM = "native", "vllm"
BOUNDED, FULL = "bounded", "full"


@dataclass(frozen=True)
class Cell:
    """One configuration of the grid."""

    problems: ProblemSet
    method: str
    budget: int | None
    n: int
    seed: int


@dataclass(frozen=True)
class RolePlan:
    """Where a model of the cell runs: `engine` NATIVE or VLLM; `cache` BOUNDED (evicting) or FULL on this engine,
    None on vLLM (its own)."""

    engine: str
    cache: str | None


@dataclass(frozen=True)
class ScorerPlan:
    """The cell's scorer: `kind` `prm` or `helper-loglik` (scorers.SCORERS), on `engine`; a PRM's recipe and input
    format (engine/prm_recipes)."""

    kind: str
    engine: str = NATIVE
    prm_recipe: str = "qwen-math"
    prm_format: str = "paper"


@dataclass(frozen=True)
class CellPlan:
    """One cell (a method at a budget and N) as every layer below the grid reads it."""

    method: str
    budget: int | None  # None for methods without an evicted cache
    n: int
    settings: SearchSettings  # what the controller decides with; its batch, step and context sizes are the cell's
    base: RolePlan | None  # None: the method samples no base candidates
    helper: RolePlan | None  # None: no helper candidates (the helper-loglik scorer may still read the helper)
    scorer: ScorerPlan
    evictor: str  # the evictor's name as config.json records it (`none` for a method without a budget)
    evictor_params: dict[str, Any] = field(default_factory=dict)  # the fields `--evictor NAME:FIELD=VALUE` gave
    recorded_params: dict[str, Any] | None = None  # every parameter of the evictor when one differs from its defaults
    accumulates: bool = False  # the evictor keeps each entry's received attention (H2O)
    buffer: int | None = None  # W past the budget on the bounded cache; None without one
    cuda_graphs: bool = True
    deterministic: bool = False
    tp: int = 1
    prompt: str = "math"  # the prompt style the policy model reads (prompts.PROMPT_STYLES)
    grading: GradingOptions = GradingOptions()

    @property
    def batch(self) -> int:
        """Problems in flight."""
        return self.settings.batch

    @property
    def max_step_tokens(self) -> int:
        return self.settings.max_step_tokens

    @property
    def context_cap(self) -> int:
        return self.settings.context_cap

    @property
    def evicts(self) -> bool:
        """Whether the base runs on the bounded evicting cache."""
        return self.base is not None and self.base.cache == BOUNDED

    @property
    def policy_role(self) -> str:
        """The model whose tokenizer reads the prompt and the steps: the base, else the helper."""
        return "base" if self.base is not None else "helper"

    def engine_of(self, role: str) -> str:
        """Where `role` (base, helper, prm) samples or scores; the helper of a method without helper candidates runs
        here (the helper-loglik scorer's)."""
        if role == "prm":
            return self.scorer.engine
        plan = self.base if role == "base" else self.helper
        return plan.engine if plan is not None else NATIVE

    def roles(self) -> set[str]:
        """The models the cell uses: its sampling roles and its scorer's (the PRM, else the helper)."""
        sampling = {role for role, plan in (("base", self.base), ("helper", self.helper)) if plan is not None}
        return sampling | {"prm" if self.scorer.kind == PRM else "helper"}

    def vllm_roles(self) -> set[str]:
        """The roles this cell runs on vLLM."""
        roles = {role for role, plan in (("base", self.base), ("helper", self.helper))
                 if plan is not None and plan.engine == VLLM}
        return roles | ({"prm"} if self.scorer.kind == PRM and self.scorer.engine == VLLM else set())

    def native_roles(self) -> set[str]:
        """The models this cell loads on this engine: its roles not on vLLM, and the helper of the helper-loglik
        scorer."""
        roles = {role for role, plan in (("base", self.base), ("helper", self.helper))
                 if plan is not None and plan.engine == NATIVE}
        if self.scorer.kind == PRM:
            return roles | ({"prm"} if self.scorer.engine == NATIVE else set())
        return roles | {"helper"}


@dataclass(frozen=True)
class GroupPlan:
    """What every device group of the grid loads and plans for: its cells' plans, the models and how they read,
    how the engine computes, and the devices. Which role each group loads here or on vLLM follows from the cells'
    plans alone."""

    cells: tuple[CellPlan, ...]
    models: ModelOptions
    engine: EngineOptions
    placement: Placement
    settings: SearchSettings

    def native_models(self) -> dict[str, str]:
        """The model of each role some cell loads on this engine (`CellPlan.native_roles`)."""
        return self._models(CellPlan.native_roles)

    def vllm_models(self) -> dict[str, str]:
        """The model of each role some cell runs on vLLM (`CellPlan.vllm_roles`)."""
        return self._models(CellPlan.vllm_roles)

    def _models(self, roles_of: Callable[[CellPlan], set[str]]) -> dict[str, str]:
        roles = set().union(*(roles_of(cell) for cell in self.cells))
        return {role: self.models.models[role] for role in sorted(roles)}
