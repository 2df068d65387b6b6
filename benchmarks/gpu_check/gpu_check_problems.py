"""gpu_check's `problems` section: problems/min of bon, kvrescue and full through `kvrescue run`'s decode code."""

from __future__ import annotations

import hashlib
import json
import time
from contextlib import nullcontext
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from benchmarks.gpu_check.gpu_check_profile import PhaseClock, profile_section
from benchmarks.gpu_check.gpu_check_record import Check, interrupted_at
from benchmarks.gpu_check.gpu_check_setup import (PARAMS, PROBLEM_RUNS, PROFILE_WINDOW, QWEN25_MATH_7B,
    QWEN25_MATH_15B, QWEN25_MATH_PRM_7B, TINY, random_loaded)
from benchmarks.gpu_check.gpu_check_streams import STREAM_RUNS, streams_comparison
from kvrescue.cell_plan import Cell
from kvrescue.data import Problem, ProblemSet
from kvrescue.cell_runners import build_cell
from kvrescue.cost import Architecture
from kvrescue.device_plan import device_kind, device_room
from kvrescue.memory_fit import headroom, largest_batch
from kvrescue.memory_plan import plan_grid
from kvrescue.decoding import decode_cell
from kvrescue.engine.loader import LoadedModel
from kvrescue.grid import GridOptions, grid_options
from kvrescue.outputs import Trace
from kvrescue_testkit.random_checkpoints import build_tokenizer
from kvrescue.search import SearchSettings

ROLES = ("base", "helper", "prm")
PROFILE_SHARE = 0.3  # of the section's own window after the budget (PROFILE_WINDOW): the profile; MATH500 the rest
# The paper's MATH500 setting (N = 8, B = 64, about 21 steps of 32 tokens; Table 1: 6,327 base and 6,560 helper tokens
# per problem), by --tiny; one batch of problems (--batch auto, at most max_problems) per method.
MATH500 = {False: dict(n=8, budget=64, synthetic=(32, 21), max_problems=512),
           True: dict(n=2, budget=16, synthetic=(4, 3), max_problems=4)}
PAPER_TOKENS = {"base": 6327, "helper": 6560}
PRM_ARCHITECTURE = "Qwen2ForProcessRewardModel"  # what marks a config as a PRM's for the planner


def problems_rate(options: GridOptions, models: dict[str, LoadedModel], problems: ProblemSet, method: str,
                  plan: dict, stop_at: float, clock: PhaseClock | None = None) -> dict:
    """Problems/min of one method over `problems` (pulled as slots free up), until all are done or `stop_at`, and a
    digest of the finished problems' outputs; with `clock`, each phase's share of the time (each model's,
    `gpu_check_profile`)."""
    cell = Cell(problems, method, None if method == "full" else plan["budget"], plan["n"], 0)
    finished: list[tuple[Trace, float]] = []
    cell_plan = options.plan_of(cell)
    engine = build_cell(cell_plan, models)
    start = time.perf_counter()
    with interrupted_at(stop_at) as cut, clock.instrument(engine) if clock is not None else nullcontext():
        decode_cell(cell_plan, cell, engine, iter(problems.problems),
                    lambda trace, _: finished.append((trace, time.perf_counter())))
    result: dict[str, Any] = {"problems": len(finished), "batch": options.settings.batch,
                              "cut": cut(), "cut_after_s": time.perf_counter() - start if cut() else None}
    if not finished:
        return {**result, "skipped": f"no problem finished in {time.perf_counter() - start:.0f} s"}
    result["planned_bytes"] = planned_bytes(options, models, method)
    seconds = finished[-1][1] - start
    traces = [t for t, _ in finished]
    result["outputs_sha256"] = hashlib.sha256(json.dumps(sorted((t.idx, t.output) for t in traces)).encode()).hexdigest()
    if clock is not None:
        result["time_share"] = clock.shares(time.perf_counter() - start)["share"]
    return {**result, "seconds": seconds, "problems_per_min": len(finished) * 60 / seconds,
            "base_tokens_per_problem": sum(t.tokens.base for t in traces) / len(traces),
            "helper_tokens_per_problem": sum(t.tokens.helper for t in traces) / len(traces),
            "peak_base_rows": max(t.peak_base_rows for t in traces)}


def architectures(models: dict[str, LoadedModel], dtype: str) -> dict[str, Architecture]:
    """The planner's view of the random models, as their config.json files would give it."""
    return {role: Architecture.from_config(role, {**m.config, "torch_dtype": dtype,
                                                  **({"architectures": [PRM_ARCHITECTURE]} if role == "prm" else {})})
            for role, m in models.items()}


def planned_bytes(options: GridOptions, models: dict[str, LoadedModel], method: str) -> int:
    """What `kvrescue run --plan` gives one cell of `method` on these models: its device's total bytes."""
    device = options.devices[0]
    return plan_grid(replace(options, methods=[method]).cell_plans(), architectures(models, options.dtype),
                     device_kind(options.group_plan(), device)).total


def auto_batch(options: GridOptions, models: dict[str, LoadedModel]) -> int:
    """What `--batch auto` chooses for the grid before loading its models: the largest batch whose plan fits the
    device's free memory (with the loaded models' bytes given back) less the headroom."""
    device = options.devices[0]
    weights = sum(p.numel() * p.element_size() for m in models.values() for p in m.net.parameters())
    room = device_room(options.group_plan(), device) + (weights if device.startswith("cuda") else 0)
    archs, kind = architectures(models, options.dtype), device_kind(options.group_plan(), device)
    plans = options.cell_plans()
    batch = largest_batch(lambda b: plan_grid(plans, archs, kind, b), room - headroom(room))
    if batch is None:
        raise RuntimeError(f"one problem's plan does not fit in {room / 2**30:.1f} GiB")
    return batch


def synthetic_grid(plan: dict, device: str, dtype: torch.dtype, problems: int) -> tuple[GridOptions, ProblemSet]:
    """The options of a bon/kvrescue/full grid on `device` with random models and synthetic steps (plan's N, budget,
    batch and steps), and `problems` synthetic problems."""
    problem_set = ProblemSet("synthetic", "generic", "gpu_check", [
        Problem(i, f"What is {i} + {2 * i}? Let x be the answer.", str(3 * i), {}) for i in range(problems)])
    settings = SearchSettings(sampling=PARAMS, batch=plan["batch"], synthetic_steps=plan["synthetic"],
                              max_step_tokens=plan["synthetic"][0], context_cap=4096)
    options = grid_options({r: f"random-{r}" for r in ROLES}, settings, Path("unused"), benches=["synthetic"],
                           methods=["bon", "kvrescue", "full"], budgets=[plan["budget"]], ns=[plan["n"]], seeds=[0],
                           evictor="rkv", devices=(device,), dtype=str(dtype).removeprefix("torch."))
    return options, problem_set


def problems_section(check: Check, device: str, dtype: torch.dtype, tiny: bool, plan: dict) -> None:
    """After a warm-up problem: problems/min of bon and kvrescue with and without CUDA graphs, full, and kvrescue with
    one stream and a stream per model (`gpu_check_streams`; within the budget); then, in a window of their own (PROFILE_WINDOW of the budget), one kvrescue cell's profile
    (`gpu_check_profile`, its first PROFILE_SHARE) and the paper's MATH500 profile at `--batch auto` (the rest)."""
    tokenizer = build_tokenizer(512)
    shapes = {"base": TINY if tiny else QWEN25_MATH_7B, "helper": TINY if tiny else QWEN25_MATH_15B,
              "prm": TINY if tiny else QWEN25_MATH_PRM_7B}
    built: dict[str, LoadedModel] = {}

    def models() -> dict[str, LoadedModel]:
        for seed, (role, shape) in enumerate(shapes.items()):
            if role not in built:
                built[role] = random_loaded(shape, device, dtype, 10 + seed, tokenizer, role)
        return built

    options, problem_set = synthetic_grid(plan, device, dtype, plan["problems"])
    problems, settings = problem_set.problems, options.settings
    end = check.deadline(1.0)
    warm = replace(options, settings=replace(settings, synthetic_steps=(plan["synthetic"][0], 1)))
    check.measure("problems", {"method": "kvrescue", "cuda_graphs": False, "warm_up": True}, end, lambda: problems_rate(
        warm, models(), replace(problem_set, problems=problems[:1]), "kvrescue", plan, end), interrupt=False)
    for i, (method, graphs) in enumerate(PROBLEM_RUNS):
        record = {"method": method, "cuda_graphs": graphs, "n": plan["n"],
                  "budget": None if method == "full" else plan["budget"], "synthetic_steps": list(plan["synthetic"])}
        if graphs and not device.startswith("cuda"):
            check.add("problems", {**record, "skipped": "CUDA graphs need a GPU"})
            continue
        share = time.perf_counter() + (end - time.perf_counter()) / (len(PROBLEM_RUNS) + len(STREAM_RUNS) - i)
        check.measure("problems", record, end, lambda: problems_rate(
            replace(options, cuda_graphs=graphs), models(), problem_set, method, plan, share), interrupt=False)
    graphs = device.startswith("cuda")
    streams_comparison(check, replace(options, cuda_graphs=graphs), models, problem_set, plan, end, problems_rate)
    profiled = replace(options, cuda_graphs=graphs,
                       settings=replace(settings, synthetic_steps=(plan["synthetic"][0], 2)))
    window = PROFILE_WINDOW * check.budget_s
    profile_section(check, profiled, models, replace(problem_set, problems=problems[:plan["batch"]]), plan, device,
                    time.perf_counter() + PROFILE_SHARE * window)
    math500_section(check, replace(options, cuda_graphs=graphs), models, tiny,
                    time.perf_counter() + (1 - PROFILE_SHARE) * window)


def math500_section(check: Check, options: GridOptions, models, tiny: bool, end: float) -> None:
    """The paper's MATH500 profile (MATH500 below) at `--batch auto`, one batch of problems per method, bon, full,
    then kvrescue with its ratios to both; each with each phase's share of its time (the models' shares)."""
    profile = MATH500[tiny]
    settings = replace(options.settings, synthetic_steps=profile["synthetic"], max_step_tokens=profile["synthetic"][0])
    grid = replace(options, settings=settings, ns=[profile["n"]], budgets=[profile["budget"]])
    record = {"profile": "MATH500", "n": profile["n"], "synthetic_steps": list(profile["synthetic"]),
              "cuda_graphs": options.cuda_graphs, "paper_tokens_per_problem": PAPER_TOKENS}
    if time.perf_counter() >= end:
        for method in ("bon", "full", "kvrescue"):
            check.add("problems", {**record, "method": method, "skipped": check.late()})
        return
    try:
        batch = min(auto_batch(grid, models()), profile["max_problems"])
    except Exception as err:  # noqa: BLE001 - recorded, as Check.measure records a failed measurement
        for method in ("bon", "full", "kvrescue"):
            check.add("problems", {**record, "method": method, "skipped": f"failed: --batch auto: {err}"[:300]})
        return
    grid = replace(grid, settings=replace(settings, batch=batch))
    _, problem_set = synthetic_grid({**profile, "batch": batch}, options.devices[0], torch.float32, batch)
    rates: dict[str, float] = {}
    for i, method in enumerate(("bon", "full", "kvrescue")):
        share = time.perf_counter() + (end - time.perf_counter()) / (3 - i)
        clock = PhaseClock(options.devices[0], sync_calls=False)

        def measured() -> dict:
            result = problems_rate(grid, models(), problem_set, method, profile, share, clock)
            if "problems_per_min" in result:
                rates[method] = result["problems_per_min"]
            if method == "kvrescue" and rates.keys() >= {"bon", "full", "kvrescue"}:
                result.update(kvrescue_over_bon=rates["kvrescue"] / rates["bon"],
                              kvrescue_over_full=rates["kvrescue"] / rates["full"])
            return result

        check.measure("problems", {**record, "method": method, "batch_auto": batch,
                                   "budget": None if method == "full" else profile["budget"]}, end, measured,
                      interrupt=False)
