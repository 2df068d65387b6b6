"""The cell plan: what runs where in one cell, decided once by `GridOptions.cell_plan` and read by the cell builder,
the memory planner and the run folder's configuration."""

from dataclasses import replace

from kvrescue.cell_plan import BOUNDED, FULL, NATIVE, VLLM, RolePlan, ScorerPlan
from kvrescue.search import SearchSettings
from kvrescue.shapes import BUFFER
from tests.helpers import small_grid


def grid(**fields):
    return small_grid(None, SearchSettings(batch=3, max_step_tokens=32, context_cap=256), **fields)


def test_each_role_runs_where_its_method_and_the_engine_put_it():
    native = grid().cell_plan("kvrescue", 16, 2)
    assert (native.base, native.helper, native.scorer) == (RolePlan(NATIVE, BOUNDED), RolePlan(NATIVE, FULL),
                                                           ScorerPlan("prm", NATIVE))
    assert (native.budget, native.n, native.batch, native.max_step_tokens, native.context_cap) == (16, 2, 3, 32, 256)
    assert native.evicts and native.buffer == BUFFER and native.evictor == "rkv" and native.policy_role == "base"
    on_vllm = grid(engine="vllm").cell_plan("kvrescue", 16, 2)  # vLLM cannot evict: the evicted base stays here
    assert (on_vllm.base, on_vllm.helper, on_vllm.scorer.engine) == (RolePlan(NATIVE, BOUNDED), RolePlan(VLLM, None),
                                                                     VLLM)
    assert on_vllm.vllm_roles() == {"helper", "prm"} and on_vllm.native_roles() == {"base"}
    full = grid(engine="vllm").cell_plan("full", 16, 2)  # no budget: the base is a full-context role
    assert full.base == RolePlan(VLLM, None) and full.budget is None and full.evictor == "none" and not full.evicts


def test_a_base_without_eviction_runs_on_a_full_cache_with_no_buffer_recorded():
    kept = grid(evictor="none").cell_plan("bon", 16, 2)
    assert kept.base == RolePlan(NATIVE, FULL) and kept.budget == 16 and kept.buffer is None
    assert kept.evictor == "none" and kept.recorded_params is None and not kept.accumulates


def test_the_helper_loglik_scorer_loads_the_helper_here_even_when_it_samples_on_vllm():
    loglik = grid(scorer="helper-loglik", engine="vllm")
    assert loglik.cell_plan("kvrescue", 16, 2).native_roles() == {"base", "helper"}
    assert loglik.cell_plan("bon", 16, 2).roles() == {"base", "helper"}
    assert grid().cell_plan("bon", 16, 2).roles() == {"base", "prm"}


def test_the_evictors_parameters_are_recorded_only_when_they_differ_from_its_defaults():
    assert grid().cell_plan("bon", 16, 2).recorded_params is None
    tuned = grid(evictor_params={"lam": 0.2}).cell_plan("bon", 16, 2)
    assert tuned.evictor_params == {"lam": 0.2} and tuned.recorded_params["lam"] == 0.2
    assert grid(evictor="h2o").cell_plan("bon", 16, 2).accumulates


def test_the_grids_plans_are_its_distinct_cells_one_budget_for_methods_without_one():
    plans = grid(methods=["bon", "full"], budgets=[16, 32], ns=[2, 4]).cell_plans()
    assert [(p.method, p.budget, p.n) for p in plans] == [("bon", 16, 2), ("bon", 16, 4), ("bon", 32, 2),
                                                          ("bon", 32, 4), ("full", None, 2), ("full", None, 4)]
    assert replace(grid(), prm_recipe="rlhflow").cell_plan("bon", 16, 2).scorer.prm_recipe == "rlhflow"


def test_a_cells_plan_carries_its_settings_prompt_and_graders():
    """What a cell's decode reads comes with its plan: the controller's settings, the prompt style, the graders."""
    settings = SearchSettings(batch=3, max_step_tokens=32, context_cap=256)
    plan = grid(prompt="think", grader="math-verify", also_grade=("qwen",)).cell_plan("bon", 16, 2)
    assert plan.settings == settings and (plan.batch, plan.max_step_tokens, plan.context_cap) == (3, 32, 256)
    assert (plan.prompt, plan.grading.grader, plan.grading.also_grade) == ("think", "math-verify", ("qwen",))


def test_a_groups_models_here_and_on_vllm_are_its_cells_roles():
    """What a device group loads here and on vLLM is the union of its cells' plans' roles; the concerns' options
    come with it as given."""
    models = {"base": "b", "helper": "h", "prm": "p"}
    group = grid(methods=["kvrescue", "full"], models=models, engine="vllm", vllm_memory=0.3).group_plan()
    assert [(c.method, c.budget) for c in group.cells] == [("kvrescue", 16), ("full", None)]
    assert group.native_models().keys() == {"base"} and group.vllm_models().keys() == {"base", "helper", "prm"}
    assert (group.engine.engine, group.engine.vllm_memory, group.placement.tp) == ("vllm", 0.3, 1)
    assert group.native_models() == {"base": "b"} and group.vllm_models() == {"base": "b", "helper": "h", "prm": "p"}
    loglik = grid(methods=["bon"], scorer="helper-loglik", models={"base": "b", "helper": "h"}).group_plan()
    assert loglik.native_models() == {"base": "b", "helper": "h"} and loglik.vllm_models() == {}
