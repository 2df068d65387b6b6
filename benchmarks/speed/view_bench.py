"""`kvrescue view` on big runs: the page's size, the time to build it and to open it in headless chromium.

    .venv/bin/python benchmarks/speed/view_bench.py [--problems 500] [--methods bon,kvrescue,full] [--budgets 64]
        [--n 8] [--steps 24] [--step-tokens 60] [--rounds 3] [--baseline main]

Run folders are written with the project's writer (`RunFolder`): per problem a number of committed steps drawn
around --steps (from a quarter to twice as many) for each bundled MATH500 problem, each step's text --step-tokens
words drawn from the MATH500 solutions, and N candidates per model and step (2N for kvrescue and interleave), each with a text of as many
words as its tokens, with full-precision floats for scores and detector statistics as real traces have. Baselines measured in the same
run, interleaved round by round: building the page vs `kvrescue report --format json` on the same folders
(the page is that report plus the traces, packed), and opening the page vs opening the page of a one-problem run
(the browser's fixed cost). Medians over --rounds; once more without candidates' texts (--no-candidate-texts).
`--baseline REF`: the same pages built by a git ref's code (exported to a temporary folder) on the same run
folders, opened in the same browser in turn with this tree's, round by round (e.g. the view before KaTeX).
Figures are printed as a table and as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from kvrescue import report as rep
from kvrescue.data import BUNDLED
from kvrescue.outputs import Candidate, ModelRef, RunConfig, RunFolder, Step, Tokens, Trace, run_dir
from kvrescue.view import write_view
from kvrescue.view.browser import headless_chromium, open_view

MODELS = {"base": ModelRef("Qwen/Qwen2.5-Math-7B-Instruct"), "helper": ModelRef("Qwen/Qwen2.5-Math-1.5B-Instruct"),
          "prm": ModelRef("Qwen/Qwen2.5-Math-PRM-7B")}
HELPED = ("kvrescue", "interleave")
ROOT = Path(__file__).resolve().parents[2]
MATHS_FRAMES = 5


def math500() -> tuple[list[str], list[str]]:
    """The bundled MATH500 problems, and the words of their solutions."""
    records = [json.loads(line) for line in (BUNDLED / "math500.jsonl").read_text(encoding="utf-8").splitlines()]
    return [r["problem"] for r in records], [w for r in records for w in r["solution"].split()]


def make_trace(rng: random.Random, words: list[str], problem: str, method: str, idx: int, budget: int | None,
               args: argparse.Namespace) -> Trace:
    steps, cands, held = [], [], 120
    for _ in range(rng.randint(max(1, args.steps // 4), 2 * args.steps)):
        per_source = {"base": 0 if method == "helper" else args.n, "helper": args.n if method in HELPED + ("helper",) else 0}
        detector = method == "kvrescue"
        options = [Candidate(src, rng.random(), rng.randint(5, 2 * args.step_tokens),
                             rng.choice(("step", "step", "step", "repetition")) if src == "base" and detector else "step",
                             rng.uniform(0.5, 8) if src == "base" and detector else None,
                             rng.uniform(0.1, 0.6) if src == "base" and detector else None)
                   for src, count in per_source.items() for _ in range(count)]
        for c in options:
            if c.finish == "repetition":
                c.score, c.fired_at = None, c.tokens
            c.text = " ".join(rng.choice(words) for _ in range(c.tokens)) + "\n\n"
        winner = max((c for c in options if c.score is not None), key=lambda c: c.score)
        winner.committed, winner.text = True, None
        text = " ".join(rng.choice(words) for _ in range(args.step_tokens)) + "\n\n"
        held += winner.tokens
        held = budget if budget is not None and held >= budget + 128 else held
        steps.append(Step(text, winner.source, winner.score, winner.tokens, base_rows=None if method == "helper" else held))
        cands.append(options)
    return Trace(idx, problem, "18", "18", steps, cands, "".join(s.text for s in steps), "18", rng.random() < 0.6,
                 False, "eos", None, Tokens(base=sum(c.tokens for cs in cands for c in cs if c.source == "base"),
                                            helper=sum(c.tokens for cs in cands for c in cs if c.source == "helper")),
                 len(steps), {"wall_s": 1.0, "started_at": 1000.0 + idx, "finished_at": 1001.0 + idx}, 192, 0)


def write_runs(root: Path, problems: int, args: argparse.Namespace) -> list[Path]:
    rng, paths = random.Random(0), []
    texts, words = math500()
    for method in args.methods.split(","):
        for budget in ([None] if method in ("full", "helper") else [int(b) for b in args.budgets.split(",")]):
            roles = {"full": ("base",), "bon": ("base",), "helper": ("helper",)}.get(method, ("base", "helper"))
            config = RunConfig("math500", method, budget, args.n, "none" if budget is None else "rkv", 0,
                               {r: MODELS[r] for r in (*roles, "prm")}, "prm", False)
            with RunFolder.open(run_dir(root, config), config, total=problems) as folder:
                for idx in range(problems):
                    folder.append(make_trace(rng, words, texts[idx % len(texts)], method, idx, budget, args))
                folder.write_summary()
            paths.append(run_dir(root, config))
    return paths


def median_ms(samples: list[float]) -> float:
    return round(1000 * statistics.median(samples), 1)


def export_tree(ref: str, into: Path) -> Path:
    """The package at git ref `ref`, exported to `into` (a baseline's code)."""
    into.mkdir()
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", ref, "kvrescue", "grader"], capture_output=True,
                             check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    return into


def build_page(code: Path | None, paths: list[Path], out: Path, candidate_texts: bool = True) -> None:
    """`kvrescue view` of `paths` into `out`, with this tree's code (None) or an exported tree's, in a fresh process."""
    if code is None:
        write_view(paths, out, candidate_texts=candidate_texts)
        return
    script = ("import sys; from pathlib import Path; from kvrescue.view import write_view; "
              "write_view([Path(p) for p in sys.argv[2:]], Path(sys.argv[1]))")
    subprocess.run([sys.executable, "-c", script, str(out), *map(str, paths)], cwd=code, check=True,
                   env={**os.environ, "PYTHONPATH": str(code)})


def open_times(driver: Any, page: Path, fragments: bool) -> dict[str, float]:
    """Seconds: opening the page afresh until its first view is drawn (wall, and the page's own time from navigation
    start); with `fragments`, then drawing the problem list and a problem page, timed in the page (route() draws the
    view the fragment names; a problem page unpacks its chunks first), and until the maths in view is drawn too
    (KaTeX draws it as its elements come into view: the last drawing within MATHS_FRAMES frames after route())."""
    start = time.perf_counter()
    times = {"drawn": open_view(driver, page) / 1000}
    times["open"] = time.perf_counter() - start
    for fragment, key in ((("#problems", "list"), ("#p/math500/0", "problem")) if fragments else ()):
        view_ms, maths_ms = driver.execute_async_script(
            "const done = arguments[arguments.length - 1];"
            f"history.replaceState(null, '', '{fragment}'); const t = performance.now();"
            "route().then(() => { const drawn = performance.now() - t; let frames = MATHS_FRAMES;"
            "  const wait = () => frames-- ? requestAnimationFrame(() => setTimeout(wait))"
            "    : done([drawn, window.KV.mathsAt > t ? window.KV.mathsAt - t : drawn]); wait(); });"
            .replace("MATHS_FRAMES", str(MATHS_FRAMES)))
        times[key], times[key + "_maths"] = view_ms / 1000, maths_ms / 1000
    return times


def page_figures(samples: dict[str, list[dict[str, float]]], big: Path, small: Path) -> dict[str, float]:
    """One tree's page sizes and median times."""
    return {"page_mb": round(big.stat().st_size / 1e6, 2), "page_one_problem_kb": round(small.stat().st_size / 1e3, 1),
            "open_ms": median_ms([t["open"] for t in samples["big"]]),
            "open_one_problem_ms": median_ms([t["open"] for t in samples["small"]]),
            "first_view_drawn_ms": median_ms([t["drawn"] for t in samples["big"]]),
            "problem_list_ms": median_ms([t["list"] for t in samples["big"]]),
            "problem_list_with_maths_ms": median_ms([t["list_maths"] for t in samples["big"]]),
            "problem_page_ms": median_ms([t["problem"] for t in samples["big"]]),
            "problem_page_with_maths_ms": median_ms([t["problem_maths"] for t in samples["big"]])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--problems", type=int, default=500)
    parser.add_argument("--methods", default="bon,kvrescue,full")
    parser.add_argument("--budgets", default="64")
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--steps", type=int, default=24, help="committed steps per problem, on average about")
    parser.add_argument("--step-tokens", type=int, default=60, help="words per committed step")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--baseline", help="a git ref whose pages of the same runs are measured beside, e.g. main")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args()
    console = Console(stderr=True)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        start = time.perf_counter()
        big, small = write_runs(tmp / "big", args.problems, args), write_runs(tmp / "small", 1, args)
        console.print(f"wrote {len(big)} run folders in {time.perf_counter() - start:.1f} s", highlight=False)
        traces_bytes = sum((p / "traces.jsonl").stat().st_size for p in big)
        trees: dict[str, Path | None] = {"this tree": None}
        if args.baseline:
            trees[args.baseline] = export_tree(args.baseline, tmp / "baseline")
        build, report_json = [], []
        samples = {name: {"big": [], "small": []} for name in trees}
        driver = headless_chromium(tmp / "profile")
        try:
            for _ in range(args.rounds):
                start = time.perf_counter()
                runs, notes = rep.load_runs(big)
                rep.to_json(rep.build_tables(runs, notes), runs, notes)
                report_json.append(time.perf_counter() - start)
                start = time.perf_counter()
                write_view(big, tmp / "big.html")
                build.append(time.perf_counter() - start)
                for i, (name, code) in enumerate(trees.items()):  # the trees in turn, on the same run folders
                    if code is not None:
                        build_page(code, big, tmp / f"big-{i}.html")
                    build_page(code, small, tmp / f"small-{i}.html")
                    samples[name]["small"].append(open_times(driver, tmp / f"small-{i}.html", fragments=False))
                    samples[name]["big"].append(open_times(driver, tmp / ("big.html" if code is None else f"big-{i}.html"),
                                                           fragments=True))
            write_view(big, tmp / "lean.html", candidate_texts=False)
            start = time.perf_counter()
            open_view(driver, tmp / "lean.html")
            open_lean = time.perf_counter() - start
        finally:
            driver.quit()
        size = (tmp / "big.html").stat().st_size
        mine = page_figures(samples["this tree"], tmp / "big.html", tmp / "small-0.html")
        figures = {
            "problems": args.problems, "runs": len(big), "n": args.n, "steps_mean": args.steps,
            "step_tokens": args.step_tokens, "traces_mb": round(traces_bytes / 1e6, 2), "page_mb": mine["page_mb"],
            "page_vs_traces": round(size / traces_bytes, 3), "page_one_problem_kb": mine["page_one_problem_kb"],
            "page_mb_no_candidate_texts": round((tmp / "lean.html").stat().st_size / 1e6, 2),
            "open_ms_no_candidate_texts": round(1000 * open_lean, 1),
            "build_ms": median_ms(build), "report_json_ms": median_ms(report_json),
            "build_vs_report_json": round(statistics.median(build) / statistics.median(report_json), 2),
            "open_ms": mine["open_ms"], "open_one_problem_ms": mine["open_one_problem_ms"],
            "open_vs_one_problem": round(mine["open_ms"] / mine["open_one_problem_ms"], 2),
            "first_view_drawn_ms": mine["first_view_drawn_ms"], "problem_list_ms": mine["problem_list_ms"],
            "problem_list_with_maths_ms": mine["problem_list_with_maths_ms"], "problem_page_ms": mine["problem_page_ms"],
            "problem_page_with_maths_ms": mine["problem_page_with_maths_ms"], "rounds": args.rounds,
        }
        if args.baseline:
            theirs = page_figures(samples[args.baseline], tmp / "big-1.html", tmp / "small-1.html")
            figures.update({f"{args.baseline}: {key}": value for key, value in theirs.items()})
    table = Table(title=f"view_bench: {args.problems} problems x {len(big)} runs, N={args.n}, ~{args.steps} steps "
                        f"of {args.step_tokens} words, median of {args.rounds} rounds")
    table.add_column("figure")
    table.add_column("value", justify="right")
    for key, value in figures.items():
        table.add_row(key, str(value))
    console.print(table)
    print(json.dumps(figures))
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2) + "\n")


if __name__ == "__main__":
    main()
