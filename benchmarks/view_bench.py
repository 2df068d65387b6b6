"""`kvrescue view` on big runs: the page's size, the time to build it and to open it in headless chromium.

    .venv/bin/python benchmarks/view_bench.py [--problems 500] [--methods bon,kvrescue,full] [--budgets 64]
        [--n 8] [--steps 24] [--step-tokens 60] [--rounds 3]

Run folders are written with the project's writer (`RunFolder`): per problem a number of committed steps drawn
around --steps (from a quarter to twice as many) for each bundled MATH500 problem, each step's text --step-tokens
words drawn from the MATH500 solutions, and N candidates per model and step (2N for kvrescue and interleave), each with a text of as many
words as its tokens, with full-precision floats for scores and detector statistics as real traces have. Baselines measured in the same
run, interleaved round by round: building the page vs `kvrescue report --format json` on the same folders
(the page is that report plus the traces, packed), and opening the page vs opening the page of a one-problem run
(the browser's fixed cost). Medians over --rounds; once more without candidates' texts (--no-candidate-texts).
Figures are printed as a table and as JSON.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from kvrescue_cli import report as rep
from kvrescue_cli.data import BUNDLED
from kvrescue_cli.outputs import Candidate, ModelRef, RunConfig, RunFolder, Step, Tokens, Trace, run_dir
from kvrescue_cli.view import write_view
from kvrescue_cli.view.browser import headless_chromium, open_view

MODELS = {"base": ModelRef("Qwen/Qwen2.5-Math-7B-Instruct"), "helper": ModelRef("Qwen/Qwen2.5-Math-1.5B-Instruct"),
          "prm": ModelRef("Qwen/Qwen2.5-Math-PRM-7B")}
HELPED = ("kvrescue", "interleave")


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--problems", type=int, default=500)
    parser.add_argument("--methods", default="bon,kvrescue,full")
    parser.add_argument("--budgets", default="64")
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--steps", type=int, default=24, help="committed steps per problem, on average about")
    parser.add_argument("--step-tokens", type=int, default=60, help="words per committed step")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args()
    console = Console(stderr=True)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        start = time.perf_counter()
        big, small = write_runs(tmp / "big", args.problems, args), write_runs(tmp / "small", 1, args)
        console.print(f"wrote {len(big)} run folders in {time.perf_counter() - start:.1f} s", highlight=False)
        traces_bytes = sum((p / "traces.jsonl").stat().st_size for p in big)
        build, report_json, open_big, open_small, drawn_big, list_ms, problem_ms = [], [], [], [], [], [], []
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
                write_view(small, tmp / "small.html")
                for page, walls, drawn in ((tmp / "small.html", open_small, []), (tmp / "big.html", open_big, drawn_big)):
                    start = time.perf_counter()
                    drawn.append(open_view(driver, page) / 1000)
                    walls.append(time.perf_counter() - start)
                # route() draws the view the fragment names (a problem page unpacks its chunks first): timed in the page.
                for fragment, samples in (("#problems", list_ms), ("#p/math500/0", problem_ms)):
                    samples.append(driver.execute_async_script(
                        "const done = arguments[arguments.length - 1];"
                        f"history.replaceState(null, '', '{fragment}'); const t = performance.now();"
                        "route().then(() => done(performance.now() - t));") / 1000)
            write_view(big, tmp / "lean.html", candidate_texts=False)
            start = time.perf_counter()
            open_view(driver, tmp / "lean.html")
            open_lean = time.perf_counter() - start
        finally:
            driver.quit()
        size = (tmp / "big.html").stat().st_size
        figures = {
            "problems": args.problems, "runs": len(big), "n": args.n, "steps_mean": args.steps,
            "step_tokens": args.step_tokens, "traces_mb": round(traces_bytes / 1e6, 2), "page_mb": round(size / 1e6, 2),
            "page_vs_traces": round(size / traces_bytes, 3),
            "page_mb_no_candidate_texts": round((tmp / "lean.html").stat().st_size / 1e6, 2),
            "open_ms_no_candidate_texts": round(1000 * open_lean, 1),
            "build_ms": median_ms(build), "report_json_ms": median_ms(report_json),
            "build_vs_report_json": round(statistics.median(build) / statistics.median(report_json), 2),
            "open_ms": median_ms(open_big), "open_one_problem_ms": median_ms(open_small),
            "open_vs_one_problem": round(statistics.median(open_big) / statistics.median(open_small), 2),
            "first_view_drawn_ms": median_ms(drawn_big), "problem_list_ms": median_ms(list_ms),
            "problem_page_ms": median_ms(problem_ms), "rounds": args.rounds,
        }
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
