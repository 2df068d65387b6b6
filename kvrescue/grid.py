"""The grid `kvrescue run` was asked for: its options (the concerns of `run_options` with the grid's axes, evictor
and search settings), validated; its cells (configurations); and each cell's plan, built here alone (`cell_plan`).
Torch-free: the evictors and PRM recipes are checked against their catalogues (`evictor_catalogue`, `prm_catalogue`)."""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from kvrescue.cell_plan import BOUNDED, FULL, NATIVE, VLLM, Cell, CellPlan, GroupPlan, RolePlan, ScorerPlan
from kvrescue.data import GENERIC, ProblemSet
from kvrescue.devices import is_cpu
from kvrescue.errors import InputError
from kvrescue.evictor_catalogue import CATALOGUE, CHOICES, MIN_BUDGET, NO_EVICTION, evictor_settings, parse_evictor
from kvrescue.methods import METHODS
from kvrescue.prm_catalogue import PRM_FORMATS, PRM_RECIPES
from kvrescue.run_options import (
    AUTO, CONCERNS, EngineOptions, GradingOptions, GridAxes, ModelOptions, Placement, RunIO, split_scorer,
)
from kvrescue.scorers import PRM
from kvrescue.search_settings import SearchSettings

MAX_CELLS = 100_000  # a grid's cells (run folders); the paper's largest grid has 400
Concern = TypeVar("Concern", RunIO, Placement, EngineOptions, ModelOptions, GradingOptions)


@dataclass(frozen=True, kw_only=True)
class GridOptions(RunIO, Placement, EngineOptions, ModelOptions, GradingOptions):
    """Everything `kvrescue run` was asked for, validated: the grid's axes, its evictor and search settings, and the
    options of each concern (`run_options`); the one builder of its cells' plans."""

    benches: list[str]
    methods: list[str]
    budgets: list[int]
    ns: list[int]
    seeds: list[int]
    evictor: str
    settings: SearchSettings
    grids: tuple[GridAxes, ...] = ()  # several grids (a --config file's [[grid]] tables); the axes above: their union
    evictor_params: dict[str, Any] = field(default_factory=dict)  # --evictor NAME:FIELD=VALUE,...: the fields given

    def _on_vllm(self, role: str, method: str) -> bool:
        """Whether `role` of `method` runs on vLLM: with `--engine vllm`, every full-context role (the helper, the
        PRM, the base of `full`); never the evicted base, since vLLM cannot evict mid-generation."""
        return self.engine == "vllm" and (role != "base" or not METHODS[method].budgeted)

    def plan_of(self, cell: Cell) -> CellPlan:
        """How `cell` runs (`cell_plan`)."""
        return self.cell_plan(cell.method, cell.budget, cell.n)

    def cell_plan(self, method: str, budget: int | None, n: int) -> CellPlan:
        """How the cell of `method` at `budget` and `n` runs (`cell_plan.CellPlan`): the one place that decides it."""
        spec, s = METHODS[method], self.settings
        evicts = spec.budgeted and self.evictor != NO_EVICTION  # `--evictor none`: a full cache

        def where(role: str, cache: str) -> RolePlan:
            return RolePlan(VLLM, None) if self._on_vllm(role, method) else RolePlan(NATIVE, cache)

        evictor = evictor_settings(self.evictor, self.evictor_params) if evicts else None
        return CellPlan(
            method=method, budget=budget if spec.budgeted else None, n=n, settings=s,
            base=where("base", BOUNDED if evicts else FULL) if spec.base else None,
            helper=where("helper", FULL) if spec.helper else None,
            scorer=ScorerPlan(self.scorer, VLLM if self.scorer == PRM and self._on_vllm("prm", method) else NATIVE,
                              self.prm_recipe, self.prm_format),
            evictor=self.evictor if spec.budgeted else NO_EVICTION,
            evictor_params=dict(self.evictor_params) if evicts else {},
            # every parameter when one differs from the defaults (the default evictors' folders keep their identity)
            recorded_params=evictor.params() if evictor is not None and evictor != CATALOGUE[self.evictor] else None,
            accumulates=evictor is not None and evictor.accumulates,
            buffer=self.buffer if evicts else None,
            cuda_graphs=self.cuda_graphs, deterministic=self.deterministic, tp=self.tp,
            prompt=self.prompt, grading=self.concern(GradingOptions),
        )

    def cell_plans(self) -> list[CellPlan]:
        """The plan of every distinct cell of the axes (`cell_plan`; of several grids, their union): each method at
        each budget (one, None, for methods without an evicted cache) and N."""
        keys = dict.fromkeys((method, budget if METHODS[method].budgeted else None, n)
                             for method in self.methods for budget in self.budgets for n in self.ns)
        return [self.cell_plan(method, budget, n) for method, budget, n in keys]

    def group_plan(self) -> GroupPlan:
        """What every device group loads and plans for (`cell_plan.GroupPlan`): the cells' plans and the concerns'
        options."""
        return GroupPlan(tuple(self.cell_plans()), self.concern(ModelOptions), self.concern(EngineOptions),
                         self.concern(Placement), self.settings)

    def concern(self, kind: type[Concern]) -> Concern:
        """The options of one concern (`run_options`) as this grid holds them."""
        return kind(**{name: getattr(self, name) for name in kind.__dataclass_fields__})

    def axes(self) -> tuple[GridAxes, ...]:
        """The grids whose cells the run executes: `grids`, else the one grid of the axes."""
        return self.grids or (GridAxes(self.benches, self.methods, self.budgets, self.ns, self.seeds),)

    def check(self) -> None:
        """One-line errors for options that can't run: the grid's own, then each concern's (`run_options`)."""
        size = sum(math.prod(len(values) for values in vars(axes).values()) for axes in self.axes())
        if size > MAX_CELLS:
            raise InputError(f"the grid has {size} cells (benches x methods x budgets x n x seeds), more than "
                             f"{MAX_CELLS}: each is a run folder; run it in parts")
        for method in self.methods:
            if method not in METHODS:
                raise InputError(f"unknown method '{method}': use one of {', '.join(METHODS)}")
        if self.evictor not in CHOICES:
            raise InputError(f"unknown evictor '{self.evictor}': use one of {', '.join(CHOICES)}")
        if self.prm_format not in PRM_FORMATS:
            raise InputError(f"--prm-format {self.prm_format!r}: expected {' or '.join(PRM_FORMATS)}")
        if self.prm_recipe not in (AUTO, *PRM_RECIPES):
            raise InputError(f"unknown --prm-recipe {self.prm_recipe!r}: use one of auto, {', '.join(PRM_RECIPES)}")
        cap = self.settings.context_cap
        for budget in self.budgets:
            if budget < MIN_BUDGET:
                raise InputError(f"--budget {budget} is below the smallest supported budget {MIN_BUDGET}")
            if budget > cap and any(METHODS[m].budgeted for m in self.methods):
                raise InputError(f"--budget {budget} is above --context-cap {cap}: a cache that large never evicts")
        refusal = self.settings.sampling.refusal() or self.settings.detector.refusal()
        if refusal:
            raise InputError(refusal)
        for n in self.ns:
            if n < 1:
                raise InputError(f"--n {n}: need at least one candidate per model")
        for concern in CONCERNS:
            concern.check(self)
        if self.engine == "vllm" and (len(self.devices) > 1 or self.ray_address is not None):
            raise InputError(f"--engine vllm runs in this process on one device, not on --devices "
                             f"{','.join(self.devices)}{' or a Ray cluster' if self.ray_address else ''}")
        if self.deterministic and self.engine == "vllm" and any(map(is_cpu, self.devices)):
            raise InputError("--deterministic with --engine vllm needs a GPU: vLLM's batch-invariant mode "
                             "(VLLM_BATCH_INVARIANT) has no CPU attention backend (docs/reproducibility.md)")
        unrecordable = self._unrecordable()
        if unrecordable:
            raise InputError(unrecordable)

    def _unrecordable(self) -> str | None:
        """Why a value config.json would record cannot be: an integer beyond 64 bits (torch and the run folders
        take none), a text that is not UTF-8 (a file name's undecodable bytes); or None. Checked before any model
        is loaded."""
        s = self.settings
        integers = {"--seed": self.seeds, "--budget": self.budgets, "--n": self.ns, "--limit": [self.limit],
                    "--shard": list(self.shard or ()), "--top-k": [s.sampling.top_k],
                    "--ent-window": [s.detector.ent_window], "--ent-min-tokens": [s.detector.min_tokens],
                    "--cmp-chars": [s.detector.cmp_chars], "--max-step-tokens": [s.max_step_tokens],
                    "--max-steps": [s.max_steps], "--context-cap": [s.context_cap], "--batch": [s.batch],
                    "--buffer": [self.buffer], "--synthetic-steps": list(s.synthetic_steps or ())}
        for option, values in integers.items():
            for value in values:
                if value is not None and not -(1 << 63) <= value < 1 << 63:
                    return f"{option} {value}: beyond 64 bits"
        texts = {"--bench": self.benches, **{f"--{role}": [model] for role, model in self.models.items()},
                 "--problem-field": [self.problem_field], "--answer-field": [self.answer_field]}
        for option, values in texts.items():
            for value in values:
                if value is not None and any("\ud800" <= c <= "\udfff" for c in value):  # undecodable bytes
                    return f"{option} {value!r}: not valid UTF-8, which config.json records; rename it"
        return None

    def cells(self, problem_sets: list[ProblemSet]) -> list[Cell]:
        """The grid (each of `grids` in turn), `problem_sets` those of `benches`; methods without an evicted cache
        run once whatever the budget list. Two problem sets that would be one run folder's bench are refused."""
        sets = dict(zip(self.benches, problem_sets))
        by_identity: dict[str, str] = {}
        for bench, problems in sets.items():
            other = by_identity.setdefault(bench_identity(problems), bench)
            if sets[other].source != problems.source:
                raise InputError(f"--bench {other} and {bench} are different problem sets under one name, "
                                 f"'{bench_identity(problems)}', which names their run folders: rename one file")
        cells, seen = [], set()
        for axes in self.axes():
            for bench, method, budget, n, seed in itertools.product(
                axes.benches, axes.methods, axes.budgets, axes.ns, axes.seeds
            ):
                cell = Cell(sets[bench], method, budget if METHODS[method].budgeted else None, n, seed)
                key = (bench_identity(sets[bench]), method, cell.budget, n, seed)
                if key not in seen:
                    seen.add(key)
                    cells.append(cell)
        return cells


def bench_identity(problems: ProblemSet) -> str:
    """The bench a cell's run folder records: a benchmark's name (a file named after one is graded as it), else
    the file's path."""
    return problems.name if problems.grading_bench != GENERIC else problems.source


def grid_options(models: dict[str, str], settings: SearchSettings, out: Path, **fields: Any) -> GridOptions:
    """The grid as `kvrescue run` builds it from its options (the CLI, benchmarks): `models` by role as --base,
    --helper and --prm give them (`prm` may name the alternative scorer: `split_scorer`); `fields`: the rest of
    `GridOptions` (its axes, evictor, ...)."""
    models, scorer = split_scorer(models)
    if "evictor" in fields:
        try:
            fields["evictor"], fields["evictor_params"] = parse_evictor(fields["evictor"])
        except ValueError as err:
            raise InputError(str(err)) from None
    return GridOptions(models=models, scorer=scorer, settings=settings, out=out, **fields)

