"""Controller cost on the CPU demo: problems/min and base tokens of `bon` vs `kvrescue`, and the share of
wall time (model loading excluded) spent outside model forwards (scheduling, sampling, detokenising, detector, bookkeeping).

    .venv/bin/python benchmarks/run_bench.py [--limit 4] [--n 2] [--budget 64] [--methods bon,kvrescue]

Every model forward (base, helper and scorer; prefill, append and decode) is timed by wrapping the
decoder's two entry points; grading is timed separately. Figures are printed as a table and as JSON.
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

import kvrescue_cli.decoding as decoding
from kvrescue_cli.engine.model import Transformer
from kvrescue_cli.engine.sampling import SamplingParams
from kvrescue_cli.smollm import smollm2_folder
from kvrescue_cli.runs import GridOptions, run_grid
from kvrescue_cli.search import SearchSettings

SPENT = {"forward": 0.0, "grade": 0.0, "load": 0.0}


def timed(function, bucket: str):
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return function(*args, **kwargs)
        finally:
            SPENT[bucket] += time.perf_counter() - start

    return wrapper


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--limit", type=int, default=4)
    parser.add_argument("--n", type=int, default=2)
    parser.add_argument("--budget", type=int, default=64)
    parser.add_argument("--methods", default="bon,kvrescue")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    Transformer.prefill = timed(Transformer.prefill, "forward")
    Transformer.decode = timed(Transformer.decode, "forward")
    decoding.grade = timed(decoding.grade, "grade")
    decoding.load_roles = timed(decoding.load_roles, "load")
    model = str(smollm2_folder())
    table = Table(title=f"run_bench: SmolLM2-135M base+helper, helper-loglik, gsm8k x{args.limit}, "
                        f"B={args.budget}, N={args.n}, {args.threads} threads")
    for column in ("method", "wall s", "problems/min", "base tok/problem", "helper tok/problem", "forward %",
                   "grading %", "outside forwards %"):
        table.add_column(column, justify="right")
    figures = []
    for method in args.methods.split(","):
        SPENT.update(forward=0.0, grade=0.0, load=0.0)
        options = GridOptions(
            benches=["gsm8k"], methods=[method], budgets=[args.budget], ns=[args.n], seeds=[0], evictor="rkv",
            models={"base": model, "helper": model, "prm": "helper-loglik"}, scorer="helper-loglik",
            settings=SearchSettings(sampling=SamplingParams(), batch=4), out=Path(tempfile.mkdtemp()),
            limit=args.limit, data_dir=None,
        )
        started = time.perf_counter()
        ((_, summary),) = run_grid(options, Progress(disable=True))
        wall = time.perf_counter() - started - SPENT["load"]  # model loading is not the controller's cost
        row = {
            "method": method, "wall_s": wall, "problems_per_min": 60 * summary.problems / wall,
            "base_tokens": summary.base_tokens, "helper_tokens": summary.helper_tokens,
            "forward_share": SPENT["forward"] / wall, "grade_share": SPENT["grade"] / wall,
            "outside_share": 1 - (SPENT["forward"] + SPENT["grade"]) / wall,
        }
        figures.append(row)
        table.add_row(method, f"{wall:.1f}", f"{row['problems_per_min']:.2f}", f"{summary.base_tokens or 0:.0f}",
                      f"{summary.helper_tokens or 0:.0f}", f"{100 * row['forward_share']:.1f}",
                      f"{100 * row['grade_share']:.1f}", f"{100 * row['outside_share']:.1f}")
    Console(stderr=True).print(table)
    print(json.dumps(figures, indent=1))


if __name__ == "__main__":
    main()
