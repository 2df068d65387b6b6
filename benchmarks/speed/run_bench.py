"""Controller cost on the CPU demo: problems/min and base tokens of `bon` vs `kvrescue`, and the share of
wall time (model loading excluded) spent outside model forwards (scheduling, sampling, detokenising, detector, bookkeeping).

    .venv/bin/python benchmarks/speed/run_bench.py [--limit 4] [--n 2] [--budget 64] [--methods bon,kvrescue] [--rounds 2]

Every model forward (base, helper and scorer; prefill, append and decode) is timed by wrapping the
decoder's two entry points; grading is timed separately (the executor's grade function, wrapped). Each method first runs once on one problem
(warm-up: first kernels, grader workers), then the methods run `--rounds` times in alternating order, each
run into a fresh folder, and the fastest run of each method is kept (a shared machine only ever adds time).
Figures are printed as a table, with problems/min relative to the first method, and as JSON.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from grader import grade
from kvrescue.engine.model import Transformer
from kvrescue.engine.sampling import SamplingParams
from kvrescue.grid import grid_options
from kvrescue.in_process import InProcessGroup
from kvrescue.runs import prepare_grid, run_cell
from kvrescue.scorers import HELPER_LOGLIK
from kvrescue.search import SearchSettings
from kvrescue.smollm import smollm2_folder

SPENT = {"forward": 0.0, "grade": 0.0}


def timed(function, bucket: str):
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return function(*args, **kwargs)
        finally:
            SPENT[bucket] += time.perf_counter() - start

    return wrapper


def run_method(method: str, args: argparse.Namespace, model: str, limit: int) -> dict:
    """One `kvrescue run` of `method` into a fresh folder: its figures, model loading excluded."""
    options, (cell,) = prepare_grid(grid_options(
        {"base": model, "helper": model, "prm": HELPER_LOGLIK}, SearchSettings(sampling=SamplingParams(), batch=4),
        Path(tempfile.mkdtemp()), benches=["gsm8k"], methods=[method], budgets=[args.budget], ns=[args.n], seeds=[0],
        evictor="rkv", limit=limit))
    group = InProcessGroup(options, options.devices, grade=timed(grade, "grade"))  # model loading: not timed
    try:
        SPENT.update(forward=0.0, grade=0.0)
        started = time.perf_counter()
        summary = run_cell(options, cell, group, Progress(disable=True))
        wall = time.perf_counter() - started
    finally:
        group.close()
    return {
        "method": method, "wall_s": wall, "problems_per_min": 60 * summary.problems / wall,
        "base_tokens": summary.base_tokens, "helper_tokens": summary.helper_tokens,
        "forward_share": SPENT["forward"] / wall, "grade_share": SPENT["grade"] / wall,
        "outside_share": 1 - (SPENT["forward"] + SPENT["grade"]) / wall,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--limit", type=int, default=4)
    parser.add_argument("--n", type=int, default=2)
    parser.add_argument("--budget", type=int, default=64)
    parser.add_argument("--methods", default="bon,kvrescue")
    parser.add_argument("--rounds", type=int, default=2, help="runs of each method, in alternating order")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    Transformer.prefill = timed(Transformer.prefill, "forward")
    Transformer.decode = timed(Transformer.decode, "forward")
    model = str(smollm2_folder())
    methods = args.methods.split(",")
    for method in methods:  # warm-up: one-off costs (first kernels, grader workers) land in no figure
        run_method(method, args, model, limit=1)
    runs: dict[str, list[dict]] = {method: [] for method in methods}
    for r in range(args.rounds):
        for method in methods if r % 2 == 0 else methods[::-1]:
            runs[method].append(run_method(method, args, model, args.limit))
    figures = [min(runs[method], key=lambda row: row["wall_s"]) for method in methods]
    for row in figures:
        row["vs_first"] = row["problems_per_min"] / figures[0]["problems_per_min"]
    table = Table(title=f"run_bench: SmolLM2-135M base+helper, helper-loglik, gsm8k x{args.limit}, "
                        f"B={args.budget}, N={args.n}, {args.threads} threads, best of {args.rounds} alternating runs")
    for column in ("method", "wall s", "problems/min", f"vs {methods[0]}", "base tok/problem", "helper tok/problem",
                   "forward %", "grading %", "outside forwards %"):
        table.add_column(column, justify="right")
    for row in figures:
        table.add_row(row["method"], f"{row['wall_s']:.1f}", f"{row['problems_per_min']:.2f}", f"{row['vs_first']:.2f}",
                      f"{row['base_tokens'] or 0:.0f}", f"{row['helper_tokens'] or 0:.0f}",
                      f"{100 * row['forward_share']:.1f}", f"{100 * row['grade_share']:.1f}",
                      f"{100 * row['outside_share']:.1f}")
    Console(stderr=True).print(table)
    print(json.dumps(figures, indent=1))


if __name__ == "__main__":
    main()
