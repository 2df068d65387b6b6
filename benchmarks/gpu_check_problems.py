"""gpu_check's `problems` section: problems/min of bon, kvrescue and full through `kvrescue run`'s decode code."""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from gpu_check_record import Check, interrupted_at
from gpu_check_setup import PARAMS, PROBLEM_RUNS, QWEN25_MATH_7B, QWEN25_MATH_15B, QWEN25_MATH_PRM_7B, TINY, random_loaded
from kvrescue_cli.data import Problem, ProblemSet
from kvrescue_cli.cell_engine import build_cell
from kvrescue_cli.cost import Architecture
from kvrescue_cli.device_plan import device_kind
from kvrescue_cli.memory_plan import plan_grid
from kvrescue_cli.decoding import decode
from kvrescue_cli.engine.loader import LoadedModel
from kvrescue_cli.grid import Cell, GridOptions, grid_options
from kvrescue_cli.outputs import Trace
from kvrescue_cli.random_checkpoints import build_tokenizer
from kvrescue_cli.search import SearchSettings

ROLES = ("base", "helper", "prm")
PRM_ARCHITECTURE = "Qwen2ForProcessRewardModel"  # what marks a config as a PRM's for the planner


def problems_rate(options: GridOptions, models: dict[str, LoadedModel], problems: ProblemSet, method: str,
                  plan: dict, stop_at: float) -> dict:
    """Problems/min of one method over `problems` (pulled as slots free up), until all are done or `stop_at`."""
    cell = Cell(problems, method, None if method == "full" else plan["budget"], plan["n"], 0)
    finished: list[tuple[Trace, float]] = []
    start = time.perf_counter()
    with interrupted_at(stop_at) as cut:
        decode(options, cell, build_cell(options, cell, models), iter(problems.problems),
               lambda trace, _: finished.append((trace, time.perf_counter())))
    result: dict[str, Any] = {"problems": len(finished), "batch": options.settings.batch,
                              "cut": cut(), "cut_after_s": time.perf_counter() - start if cut() else None}
    if not finished:
        return {**result, "skipped": f"no problem finished in {time.perf_counter() - start:.0f} s"}
    result["planned_bytes"] = planned_bytes(options, models, method)
    seconds = finished[-1][1] - start
    traces = [t for t, _ in finished]
    return {**result, "seconds": seconds, "problems_per_min": len(finished) * 60 / seconds,
            "base_tokens_per_problem": sum(t.tokens.base for t in traces) / len(traces),
            "helper_tokens_per_problem": sum(t.tokens.helper for t in traces) / len(traces),
            "peak_base_rows": max(t.peak_base_rows for t in traces)}


def planned_bytes(options: GridOptions, models: dict[str, LoadedModel], method: str) -> int:
    """What `kvrescue run --plan` gives one cell of `method` on these models: its device's total bytes."""
    archs = {role: Architecture.from_config(role, {**m.config, "torch_dtype": options.dtype,
                                                   **({"architectures": [PRM_ARCHITECTURE]} if role == "prm" else {})})
             for role, m in models.items()}
    device = options.devices[0]
    return plan_grid(replace(options, methods=[method]), device_kind(options, device), models=archs).total


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
    """problems/min of bon and kvrescue with and without CUDA graphs, and full, after a warm-up problem."""
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
        share = time.perf_counter() + (end - time.perf_counter()) / (len(PROBLEM_RUNS) - i)
        check.measure("problems", record, end, lambda: problems_rate(
            replace(options, cuda_graphs=graphs), models(), problem_set, method, plan, share), interrupt=False)
