"""What decodes one cell: fresh caches and runners for its roles, its scorer, and the policy's tokenizer, built from
its `CellPlan`; the one place they are built (`build_cell`), so that a benchmark swaps a part through `CellParts`,
not by patching."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import kvrescue.engine.invariance as invariance
from kvrescue import engine_bytes
from kvrescue.cell_plan import BOUNDED, VLLM, CellPlan
from kvrescue.engine.bounded import BoundedCache
from kvrescue.engine.caches import FullCache
from kvrescue.engine.evictors.registry import make_evictor
from kvrescue.engine.loader import LoadedModel
from kvrescue.engine.prm import PRMScorer
from kvrescue.engine.prm_recipes import get_recipe
from kvrescue.engine.runner import Runner
from kvrescue.engine.scoring import HelperLoglik, Request, Scorer
from kvrescue.engine.streams import ModelStream
from kvrescue.engine.tp import values_from_rank_0
from kvrescue.scorers import PRM
from kvrescue.search import StepRunner
from kvrescue.vllm_engine.roles import VllmEngines


@dataclass(frozen=True)
class CellParts:
    """Parts a cell is built from that a caller may replace: the full-context cache's class (base `full`, helper,
    helper-loglik scorer), and a scorer in place of the grid's."""

    full_cache: type[FullCache] = FullCache
    scorer: Scorer | None = None


@dataclass
class CellRunners:
    """One cell's runners (by role), its scorer, and the policy's tokenizer and EOS ids."""

    runners: dict[str, StepRunner]
    scorer: Scorer
    tokenizer: Any
    eos_ids: set[int]


class RankZeroScores:
    """A scorer of a `--tp` group whose scores every rank takes from rank 0: the scorer's copies on different
    subgroups may score near-ties the other way round, and the winners decide every later collective's shape."""

    def __init__(self, scorer: Scorer) -> None:
        self.scorer, self.name = scorer, scorer.name

    def open(self, key: int, problem: str, prompt: list[int]) -> None:
        self.scorer.open(key, problem, prompt)

    def score(self, requests: list[Request]) -> list[float]:
        return values_from_rank_0(self.scorer.score(requests))

    def commit(self, key: int, text: str, tokens: list[int]) -> None:
        self.scorer.commit(key, text, tokens)

    def close(self, key: int) -> tuple[int, int]:
        return self.scorer.close(key)


def full_tokens(plan: CellPlan) -> int:
    """Token room of a full-context cache (base `full`, helper) for the cell."""
    return engine_bytes.full_cache_tokens(plan.batch, plan.n, plan.max_step_tokens, plan.context_cap)


def full_rows(plan: CellPlan) -> dict[str, int]:
    """Row limits of a full-context cache for the cell: its rows (2N + 2 per problem), and its longest row, a context
    just under the cap and a whole step past it (a 32k cap takes 32k-token rows)."""
    return dict(max_rows=plan.batch * (2 * plan.n + 2), max_row_tokens=plan.context_cap + plan.max_step_tokens)


def loglik_tokens(plan: CellPlan) -> int:
    """Token room of the helper-loglik scorer's cache."""
    return engine_bytes.loglik_cache_tokens(plan.batch, plan.n, plan.max_step_tokens, plan.context_cap)


def _runners(plan: CellPlan, models: dict[str, LoadedModel], vllm: VllmEngines | None,
             full: type[FullCache]) -> dict[str, StepRunner]:
    """Fresh caches for one cell: the base evicted or full, the helper full; a role on vLLM, a fresh `VllmRunner`."""
    runners: dict[str, StepRunner] = {}
    for role, where in (("base", plan.base), ("helper", plan.helper)):
        if where is None:
            continue
        if where.engine == VLLM:
            runners[role] = vllm.runner(role)
            continue
        net = models[role].net
        cache = (BoundedCache.for_model(net, plan.budget, make_evictor(plan.evictor, plan.evictor_params),
                                        buffer=plan.buffer, max_append=plan.max_step_tokens,
                                        rows=plan.batch * (plan.n + 1))
                 if where.cache == BOUNDED else full.for_model(net, full_tokens(plan), **full_rows(plan)))
        runners[role] = Runner(models[role], cache, cuda_graphs=plan.cuda_graphs,
                               stream=ModelStream.of(models[role].device, role))
    return runners


def _scorer(plan: CellPlan, models: dict[str, LoadedModel], vllm: VllmEngines | None,
            full: type[FullCache]) -> Scorer:
    if plan.scorer.kind == PRM:
        if plan.scorer.engine == VLLM:
            return vllm.scorer()
        return PRMScorer(models["prm"], max_problems=plan.batch, max_candidates=plan.batch * 2 * plan.n,
                         max_step_tokens=plan.max_step_tokens,
                         recipe=get_recipe(plan.scorer.prm_recipe, plan.scorer.prm_format),
                         stream=ModelStream.of(models["prm"].device, "prm"), cuda_graphs=plan.cuda_graphs)
    helper = models["helper"]
    cache = full.for_model(helper.net, loglik_tokens(plan), **full_rows(plan))
    return HelperLoglik(Runner(helper, cache, stream=ModelStream.of(helper.device, "helper")))


def build_cell(plan: CellPlan, models: dict[str, LoadedModel], vllm: VllmEngines | None = None,
               parts: CellParts = CellParts()) -> CellRunners:
    """The runners, scorer and policy tokenizer of the cell `plan` (`GridOptions.cell_plan`), on `models`
    (`load_roles`) and the engines of the roles on vLLM (`--engine vllm`); with `--tp K` every rank takes rank 0's
    scores. Turns this process's batch invariance on or off (`--deterministic`)."""
    invariance.enable(plan.deterministic)
    role = plan.policy_role
    tokenizer, eos_ids = vllm.tokenizers[role] if plan.engine_of(role) == VLLM else \
        (models[role].tokenizer, models[role].eos_ids)
    scorer = parts.scorer or _scorer(plan, models, vllm, parts.full_cache)
    runners = _runners(plan, models, vllm, parts.full_cache)
    return CellRunners(runners, RankZeroScores(scorer) if plan.tp > 1 else scorer, tokenizer, set(eos_ids))
