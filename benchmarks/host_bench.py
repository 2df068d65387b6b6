"""Host cost of the decode loop: wall µs per candidate token of a whole `kvrescue run` cell on a near-free model.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/host_bench.py [--baseline main~1] [--rounds 2] [--profile]

The real controller, runners and caches (the cell decode `kvrescue run` calls, without the run folder) decode kvrescue,
N = 8, 64 problems in flight (1,024 live candidate rows: 512 base on the evicted cache, 512 helper on the
full cache), synthetic 32-token steps, on random Qwen2 checkpoints of 2 layers and width 16, so that
almost nothing but host work is left. Figures: wall time / candidate tokens, with the PRM (a random PRM of
the same size scores every step) and without it (a constant scorer, so only the decode loop is left).

`--baseline REF` measures the same cell with the code of a git ref (exported to a temporary folder and
imported first), interleaved with this tree's round by round; each figure is the best of `--rounds`
(a shared machine only adds time). `--profile` prints the top entries of a cProfile of this tree's run.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHAPE = dict(hidden_size=16, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=32)


def measure(scorer: str, steps: int, problems: int, profile: bool) -> dict:
    """One cell through `decode` (what `run_cell` calls, minus the run folder); returns µs per candidate
    token (model loading excluded; grading included)."""
    import kvrescue_cli
    import kvrescue_cli.runs as runs
    from kvrescue_cli.data import Problem, ProblemSet
    from kvrescue_cli.engine.loader import load_model
    from kvrescue_cli.search import SearchSettings
    try:
        from kvrescue_cli.random_checkpoints import write_random_checkpoint
        import kvrescue_cli.decoding as decoding  # where `_scorer` lives since the grid was split for Ray
    except ImportError:  # a baseline from before those moves
        from kvrescue_cli.engine.random_checkpoints import write_random_checkpoint
        decoding = runs  # `decode` lived in runs too

    class ConstantScorer:
        """Every candidate scores 0.5 (the first one is committed): the decode loop without a scorer."""

        name = "constant"

        def open(self, key, problem, prompt): pass
        def score(self, requests): return [0.5] * len(requests)
        def commit(self, key, text, tokens): pass
        def close(self, key): return 0, 0

    with tempfile.TemporaryDirectory() as tmp:
        policy = load_model(write_random_checkpoint(Path(tmp) / "policy", "qwen2", seed=1, **SHAPE))
        prm = load_model(write_random_checkpoint(Path(tmp) / "prm", "prm", seed=2, **SHAPE))
        models = {"base": policy, "helper": policy, "prm": prm}
        if scorer == "none":
            decoding._scorer = lambda options, cell, models: ConstantScorer()
        settings = SearchSettings(batch=problems, synthetic_steps=(32, steps), max_step_tokens=32, context_cap=4096)
        options = runs.GridOptions(
            benches=["synthetic"], methods=["kvrescue"], budgets=[64], ns=[8], seeds=[0], evictor="rkv",
            models={"base": "policy", "helper": "policy", "prm": "prm"}, scorer="prm", settings=settings,
            out=Path(tmp) / "runs")
        items = [Problem(i, f"What is {i} + {2 * i}? Let x be the answer.", str(3 * i), {}) for i in range(problems)]
        cell = runs.Cell(ProblemSet("synthetic", "generic", "host_bench", items), "kvrescue", 64, 8, 0)
        profiler = None
        if profile:
            import cProfile
            profiler = cProfile.Profile()
            profiler.enable()
        generated = []
        start = time.perf_counter()
        decoding.decode(options, cell, models, items, lambda trace, tokens: generated.append(tokens))
        seconds = time.perf_counter() - start
        top = ""
        if profiler is not None:
            import io
            import pstats
            profiler.disable()
            out = io.StringIO()
            pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(18)
            top = out.getvalue()
    tokens = sum(generated)
    return {"code": str(Path(kvrescue_cli.__file__).parents[1]), "scorer": scorer, "seconds": seconds,
            "candidate_tokens": tokens, "us_per_token": 1e6 * seconds / tokens, "profile": top}


def run_worker(code: Path, scorer: str, args) -> dict:
    """`measure` in a fresh process importing kvrescue_cli from `code` (a source tree)."""
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    prelude = f"import sys; sys.path.insert(0, {str(code)!r}); sys.path.insert(0, {str(ROOT / 'benchmarks')!r})"
    call = (f"{prelude}; import host_bench, json; "
            f"print(json.dumps(host_bench.measure({scorer!r}, {args.steps}, {args.problems}, {args.profile!r})))")
    done = subprocess.run([sys.executable, "-c", call], capture_output=True, text=True, env=env, cwd=code)
    if done.returncode != 0:
        raise SystemExit(f"host_bench: the run with {code} failed:\n{done.stderr[-3000:]}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    if Path(result["code"]).resolve() != code.resolve():
        raise SystemExit(f"host_bench: imported kvrescue_cli from {result['code']}, not {code}")
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", help="a git ref to measure beside this tree, e.g. main~3")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3, help="synthetic steps per problem")
    parser.add_argument("--problems", type=int, default=64)
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args()
    trees = {"this tree": ROOT}
    with tempfile.TemporaryDirectory() as tmp:
        if args.baseline:
            export = Path(tmp) / "baseline"
            export.mkdir()
            archive = subprocess.run(["git", "-C", str(ROOT), "archive", args.baseline, "kvrescue_cli", "grader"],
                                     capture_output=True, check=True).stdout
            subprocess.run(["tar", "-x", "-C", str(export)], input=archive, check=True)
            trees[args.baseline] = export
        best: dict[tuple[str, str], dict] = {}
        for _ in range(args.rounds):
            for scorer in ("prm", "none"):
                for name, code in trees.items():
                    result = run_worker(code, scorer, args)
                    key = (name, scorer)
                    if key not in best or result["us_per_token"] < best[key]["us_per_token"]:
                        best[key] = result
    rows = []
    for (name, scorer), result in best.items():
        mine = best[("this tree", scorer)]["us_per_token"]
        rows.append({"code": name, "scorer": scorer, "us_per_candidate_token": round(result["us_per_token"], 2),
                     "candidate_tokens": result["candidate_tokens"], "seconds": round(result["seconds"], 2),
                     "ratio_to_this_tree": round(result["us_per_token"] / mine, 2)})
        print(f"{name:>12}  scorer={scorer:<4}  {result['us_per_token']:7.2f} µs/candidate token  "
              f"({result['candidate_tokens']:.0f} tokens, {result['seconds']:.1f} s, x{rows[-1]['ratio_to_this_tree']:.2f})",
              file=sys.stderr)
    if args.profile:
        print(best[("this tree", "none")]["profile"], file=sys.stderr)
    print(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
