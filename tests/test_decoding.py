"""A cell's decode grades finished problems off the decode thread and emits their traces on it."""

import threading

from grader import grade
from kvrescue.cell_runners import build_cell
from kvrescue.decoding import decode_cell
from kvrescue.group_models import load_roles
from kvrescue.search import SearchSettings
from tests.helpers import small_cell, small_grid, sums


def test_the_decode_goes_on_while_a_problem_is_graded(qwen2_dir, prm_dir, tmp_path):
    models = {"base": str(qwen2_dir), "helper": str(qwen2_dir), "prm": str(prm_dir)}
    options = small_grid(tmp_path, SearchSettings(batch=1, synthetic_steps=(4, 2), max_step_tokens=8, context_cap=256),
                         models=models)
    problems = sums(4)
    cell = small_cell(problems)
    last_retired = threading.Event()

    def pulled():
        """The problems as the decode pulls them: one in flight (batch 1), so it asks past the last one only once
        that one retired."""
        yield from problems
        last_retired.set()

    graded_on = []

    def grade_slowly(output, gt, bench, **options):
        graded_on.append(threading.current_thread())
        if gt == "1":  # problem 0: its grading ends only once the decode retired the last problem
            assert last_retired.wait(60), "the decode waited for the grader"
        return grade(output, gt, bench, **options)

    emitted = []
    plan = options.plan_of(cell)
    decode_cell(plan, cell, build_cell(plan, load_roles(options.group_plan(), "cpu")), pulled(),
                lambda trace, tokens: emitted.append((trace, tokens, threading.current_thread())), grade=grade_slowly)
    assert [trace.idx for trace, _, _ in emitted] == [0, 1, 2, 3]  # in the order they finished, each once
    assert all(thread is threading.current_thread() for _, _, thread in emitted)
    assert graded_on and all(thread is not threading.current_thread() for thread in graded_on)
    for trace, tokens, _ in emitted:
        verdict = grade(trace.output, trace.gt, "generic")
        assert (trace.pred, trace.correct, trace.gt_norm) == (verdict.pred, verdict.correct, verdict.gt)
        assert tokens == trace.tokens.base == 2 * 2 * 4  # N = 2 candidates x 2 steps x 4 tokens


def test_a_cell_is_built_from_the_parts_given(qwen2_dir, prm_dir, tmp_path):
    """`build_cell` takes the full-context cache's class and a scorer from `CellParts` (the benchmarks' seam), and
    the grid's own otherwise; `--prm helper-loglik` names the scorer, not a model."""
    from kvrescue.cell_runners import CellParts
    from kvrescue.engine.caches import FullCache
    from kvrescue.engine.prm import PRMScorer
    from kvrescue.engine.scoring import HelperLoglik
    from kvrescue.grid import grid_options

    class Marked(FullCache):
        pass

    settings = SearchSettings(batch=1, max_step_tokens=8, context_cap=256)
    options = grid_options({"base": str(qwen2_dir), "helper": str(qwen2_dir), "prm": str(prm_dir)}, settings, tmp_path,
                           benches=["t"], methods=["full"], budgets=[16], ns=[2], seeds=[0], evictor="rkv")
    cell = small_cell(method="full", budget=None)
    models = load_roles(options.group_plan(), "cpu")
    scorer = HelperLoglik(None)
    built = build_cell(options.plan_of(cell), models, parts=CellParts(full_cache=Marked, scorer=scorer))
    assert type(built.runners["base"].cache) is Marked and built.scorer is scorer
    own = build_cell(options.plan_of(cell), models)
    assert type(own.runners["base"].cache) is FullCache and isinstance(own.scorer, PRMScorer)
    loglik = grid_options({"base": str(qwen2_dir), "helper": str(qwen2_dir), "prm": "helper-loglik"}, settings,
                          tmp_path, benches=["t"], methods=["full"], budgets=[16], ns=[2], seeds=[0], evictor="rkv")
    assert (loglik.scorer, "prm" in loglik.models) == ("helper-loglik", False)
    assert isinstance(build_cell(loglik.plan_of(cell), load_roles(loglik.group_plan(), "cpu")).scorer, HelperLoglik)
