"""What decodes one cell: fresh caches and runners for its roles, its scorer, and the policy's tokenizer; the one
place they are built (`build_cell`), so that a benchmark swaps a part through `CellParts`, not by patching."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvrescue_cli import memory_plan as planner
import kvrescue_cli.engine.invariance as invariance
from kvrescue_cli.engine.bounded import BoundedCache
from kvrescue_cli.engine.caches import FullCache
from kvrescue_cli.engine.loader import LoadedModel
from kvrescue_cli.engine.prm import PRMScorer
from kvrescue_cli.engine.runner import Runner
from kvrescue_cli.engine.scoring import HelperLoglik, Scorer
from kvrescue_cli.grid import Cell, GridOptions
from kvrescue_cli.methods import METHODS
from kvrescue_cli.rank_group import RankZeroScores
from kvrescue_cli.scorers import PRM
from kvrescue_cli.search import SearchSettings, StepRunner
from kvrescue_cli.vllm_engine.roles import VllmEngines


@dataclass(frozen=True)
class CellParts:
    """Parts a cell is built from that a caller may replace: the full-context cache's class (base `full`, helper,
    helper-loglik scorer), and a scorer in place of the grid's."""

    full_cache: type[FullCache] = FullCache
    scorer: Scorer | None = None


@dataclass
class CellEngine:
    """One cell's runners (by role), its scorer, and the policy's tokenizer and EOS ids."""

    runners: dict[str, StepRunner]
    scorer: Scorer
    tokenizer: Any
    eos_ids: set[int]


def full_tokens(s: SearchSettings, n: int) -> int:
    """Token room of a full-context cache (base `full`, helper) for a cell of N candidates."""
    return planner.full_cache_tokens(s.batch, n, s.max_step_tokens, s.context_cap)


def full_rows(s: SearchSettings, n: int) -> dict[str, int]:
    """Row limits of a full-context cache for a cell of N candidates: its rows (2N + 2 per problem), and its longest
    row, a context just under the cap and a whole step past it (a 32k cap takes 32k-token rows)."""
    return dict(max_rows=s.batch * (2 * n + 2), max_row_tokens=s.context_cap + s.max_step_tokens)


def loglik_tokens(s: SearchSettings, n: int) -> int:
    """Token room of the helper-loglik scorer's cache."""
    return planner.loglik_cache_tokens(s.batch, n, s.max_step_tokens, s.context_cap)


def _runners(options: GridOptions, cell: Cell, models: dict[str, LoadedModel], vllm: VllmEngines | None,
             full: type[FullCache]) -> dict[str, StepRunner]:
    """Fresh caches for one cell: the base evicted or full, the helper full; a role on vLLM, a fresh `VllmRunner`."""
    spec, s = METHODS[cell.method], options.settings
    runners: dict[str, StepRunner] = {}
    for role in sorted(options.vllm_roles([cell.method]) - {"prm"}):
        runners[role] = vllm.runner(role)
    if spec.base and "base" not in runners:
        base = models["base"]
        cache = (BoundedCache.for_model(base.net, cell.budget, options.policy(), buffer=options.buffer,
                                        max_append=s.max_step_tokens, rows=s.batch * (cell.n + 1))
                 if options.evicts(cell.method)
                 else full.for_model(base.net, full_tokens(s, cell.n), **full_rows(s, cell.n)))
        runners["base"] = Runner(base, cache, cuda_graphs=options.cuda_graphs)
    if spec.helper and "helper" not in runners:
        helper = models["helper"]
        cache = full.for_model(helper.net, full_tokens(s, cell.n), **full_rows(s, cell.n))
        runners["helper"] = Runner(helper, cache, cuda_graphs=options.cuda_graphs)
    return runners


def _scorer(options: GridOptions, cell: Cell, models: dict[str, LoadedModel], vllm: VllmEngines | None,
            full: type[FullCache]) -> Scorer:
    s = options.settings
    if options.scorer == PRM:
        if options.on_vllm("prm", cell.method):
            return vllm.scorer()
        return PRMScorer(models["prm"], max_problems=s.batch, max_candidates=s.batch * 2 * cell.n,
                         max_step_tokens=s.max_step_tokens, recipe=options.prm_input_recipe())
    helper = models["helper"]
    cache = full.for_model(helper.net, loglik_tokens(s, cell.n), **full_rows(s, cell.n))
    return HelperLoglik(Runner(helper, cache))


def build_cell(options: GridOptions, cell: Cell, models: dict[str, LoadedModel], vllm: VllmEngines | None = None,
               parts: CellParts = CellParts()) -> CellEngine:
    """The runners, scorer and policy tokenizer of one cell, on `models` (`load_roles`) and the engines of the roles
    on vLLM (`--engine vllm`); with `--tp K` every rank takes rank 0's scores. Turns this process's batch
    invariance on or off (`--deterministic`)."""
    invariance.enable(options.deterministic)
    role = "base" if METHODS[cell.method].base else "helper"
    tokenizer, eos_ids = vllm.tokenizers[role] if options.on_vllm(role, cell.method) else \
        (models[role].tokenizer, models[role].eos_ids)
    scorer = parts.scorer or _scorer(options, cell, models, vllm, parts.full_cache)
    runners = _runners(options, cell, models, vllm, parts.full_cache)
    return CellEngine(runners, RankZeroScores(scorer) if options.tp > 1 else scorer, tokenizer, set(eos_ids))
