"""Host cost of the decode loop: µs per candidate token of a `kvrescue run` cell on a near-free model, split
into host time (what would keep a GPU waiting) and tensor-op time.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/speed/host_bench.py [--baseline e1e97a2] [--rounds 2] [--whole 8] [--profile]

The real controller, runners and caches (the cell decode `kvrescue run` calls, without the run folder) decode kvrescue,
N = 8, 64 problems in flight (1,024 live candidate rows: 512 base on the evicted cache, 512 helper on the
full cache), synthetic 32-token steps, on random Qwen2 checkpoints of 2 layers and width 16, so that
almost nothing but host work is left. Figures: wall time / candidate tokens, with the PRM (a random PRM of
the same size scores every step) and without it (a constant scorer, so only the decode loop is left); the
grader's verdicts are instant in both (the whole run below grades for real).

`--baseline REF` measures the same cell with the code of a git ref (exported to a temporary folder and
imported first), interleaved with this tree's round by round; each figure is the best of `--rounds`
(a shared machine only adds time). `--profile` prints the top entries of a cProfile of this tree's run.

The split: one more run of each cell under torch.profiler (CPU activity). Tensor-op time is the CPU time of
the outermost aten ops (each op's own span, its nested ops included); host time is the profiled wall time
minus it: the Python of the loop, the tokenizer, grading, and the profiler's bookkeeping between ops (so it is
an upper bound). Both are divided by the candidate tokens. On a GPU the ops' tensor work moves to the device,
but each op still costs the host a launch: `ops/token` counts the outermost ops per candidate token.

`--whole STEPS` also times the whole command of the issue for each tree, in a fresh process from start to
exit (imports, loading, run folder, grading): `kvrescue run --method kvrescue --n 8 --batch 64
--synthetic-steps 32:STEPS` on the same random checkpoints, µs of wall time per candidate token.
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

ROOT = Path(__file__).resolve().parents[2]
SHAPE = dict(hidden_size=16, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=32)
AIM_HOST_US, AIM_WHOLE_US = 5.0, 10.0  # the aims, µs per candidate token


def _checkpoints(folder: Path) -> tuple[Path, Path]:
    """The random policy and PRM checkpoints (written by this checkout's kit, whichever tree loads them)."""
    from kvrescue_testkit.random_checkpoints import write_random_checkpoint

    return (write_random_checkpoint(folder / "policy", "qwen2", seed=1, **SHAPE),
            write_random_checkpoint(folder / "prm", "prm", seed=2, **SHAPE))


def _start_template_worker(tokenizer) -> None:
    """Render one prompt, so that the process's chat-template worker (since 5 December 2026: a Python process
    importing transformers, about 0.7 s, once a process) is up before the timed decode, as the models are loaded."""
    try:
        from kvrescue.chat_templates import render_chat
    except ImportError:  # a baseline that rendered templates in its own process
        return
    render_chat(tokenizer, [{"role": "user", "content": "1 + 1?"}], add_generation_prompt=True)


def _op_split(profile) -> dict:
    """Tensor-op time and count of a torch.profiler run: its outermost aten ops, and the top ones by self time."""
    outer = [e for e in profile.events() if e.cpu_parent is None and e.name.startswith("aten::")]
    averages = sorted(profile.key_averages(), key=lambda a: a.self_cpu_time_total, reverse=True)[:12]
    top = [(a.key, a.count, round(a.self_cpu_time_total / 1e3, 1)) for a in averages]
    return {"op_seconds": sum(e.cpu_time_total for e in outer) / 1e6, "ops": len(outer), "top_ops": top}


def _cell_decoder(models: dict, settings, out: Path, items: list, scorer, grade):
    """The kvrescue cell of `items` built through the public seams (`build_cell` with a scorer in place of the
    grid's, `decode_cell` with a grade function; `cell_engine.build_cell` and `decode` in a baseline from before
    their renaming, the grid's options in place of the cell's plan before `decode_cell` read the plan, and in
    `build_cell` before the cells had plans); a baseline from before them (no `cell_engine`) is patched as it was."""
    from kvrescue.data import ProblemSet
    try:
        from kvrescue.grid import grid_options
        try:
            from kvrescue.cell_runners import CellParts, build_cell
            from kvrescue.decoding import decode_cell
        except ImportError:  # a baseline from before the renaming
            from kvrescue.cell_engine import CellParts, build_cell
            from kvrescue.decoding import decode as decode_cell
        try:
            from kvrescue.cell_plan import Cell
            reads_plan = True
        except ImportError:  # a baseline whose decode read the grid's options
            from kvrescue.grid import Cell
            reads_plan = False
    except ImportError:
        return _old_cell_decoder(models, settings, out, items, scorer, grade)
    options = grid_options({"base": "policy", "helper": "policy", "prm": "prm"}, settings, out,
                           benches=["synthetic"], methods=["kvrescue"], budgets=[64], ns=[8], seeds=[0], evictor="rkv")
    cell = Cell(ProblemSet("synthetic", "generic", "host_bench", items), "kvrescue", 64, 8, 0)
    parts = CellParts(scorer=scorer)
    if hasattr(options, "plan_of"):
        plan = options.plan_of(cell)
        engine = lambda: build_cell(plan, models, parts=parts)  # noqa: E731
    else:  # a baseline from before the cells' plans (a82926b): its build_cell read the options and the cell
        engine = lambda: build_cell(options, cell, models, parts=parts)  # noqa: E731
    return lambda emit: decode_cell(plan if reads_plan else options, cell, engine(), items, emit, grade=grade)


def _old_cell_decoder(models: dict, settings, out: Path, items: list, scorer, grade):
    """A baseline's cell decode, from before the seams: its module's scorer and grader replaced."""
    import kvrescue.runs as runs
    from kvrescue.data import ProblemSet
    try:
        import kvrescue.decoding as decoding  # where `_scorer` lived since the grid was split for Ray
    except ImportError:  # a baseline from before that move
        decoding = runs  # `decode` lived in runs too
    if scorer is not None:
        decoding._scorer = lambda *args: scorer  # (options, cell, models[, engines])
    decoding.grade = grade
    options = runs.GridOptions(
        benches=["synthetic"], methods=["kvrescue"], budgets=[64], ns=[8], seeds=[0], evictor="rkv",
        models={"base": "policy", "helper": "policy", "prm": "prm"}, scorer="prm", settings=settings, out=out)
    cell = runs.Cell(ProblemSet("synthetic", "generic", "host_bench", items), "kvrescue", 64, 8, 0)
    return lambda emit: decoding.decode(options, cell, models, items, emit)


def measure(scorer: str, steps: int, problems: int, mode: str) -> dict:
    """One cell through `decode` (what `run_cell` calls, minus the run folder); returns µs per candidate
    token (model loading and grading excluded). mode: "wall", "ops" (under torch.profiler) or "cprofile"."""
    import kvrescue
    from kvrescue.data import Problem
    from kvrescue.engine.loader import load_model
    from kvrescue.search import SearchSettings

    class ConstantScorer:
        """Every candidate scores 0.5 (the first one is committed): the decode loop without a scorer."""

        name = "constant"

        def open(self, key, problem, prompt): pass
        def score(self, requests): return [0.5] * len(requests)
        def commit(self, key, text, tokens): pass
        def close(self, key): return 0, 0

    def instant(output, gt, bench, **kw):
        # The grader's verdict is instant, as the PRM's is without a scorer: every problem of the cell finishes at
        # once here, so a grading thread could hide nothing, and the grader's cost is its own (grade_bench).
        # The whole run (`--whole`) grades for real.
        from grader import GradeResult
        return GradeResult(False, "", gt)

    with tempfile.TemporaryDirectory() as tmp:
        policy_dir, prm_dir = _checkpoints(Path(tmp))
        policy, prm = load_model(policy_dir), load_model(prm_dir)
        _start_template_worker(policy.tokenizer)
        models = {"base": policy, "helper": policy, "prm": prm}
        settings = SearchSettings(batch=problems, synthetic_steps=(32, steps), max_step_tokens=32, context_cap=4096)
        items = [Problem(i, f"What is {i} + {2 * i}? Let x be the answer.", str(3 * i), {}) for i in range(problems)]
        constant = ConstantScorer() if scorer == "none" else None
        decode_cell = _cell_decoder(models, settings, Path(tmp) / "runs", items, constant, instant)
        generated = []
        run = lambda: decode_cell(lambda trace, tokens: generated.append(tokens))  # noqa: E731
        result: dict = {}
        if mode == "ops":
            from torch.profiler import ProfilerActivity, profile
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                start = time.perf_counter()
                run()
                seconds = time.perf_counter() - start
            result = _op_split(prof)
        elif mode == "cprofile":
            import cProfile
            import io
            import pstats
            profiler = cProfile.Profile()
            start = time.perf_counter()
            profiler.runcall(run)
            seconds = time.perf_counter() - start
            out = io.StringIO()
            pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(18)
            result = {"profile": out.getvalue()}
        else:
            start = time.perf_counter()
            run()
            seconds = time.perf_counter() - start
    tokens = sum(generated)
    return {"code": str(Path(kvrescue.__file__).parents[1]), "scorer": scorer, "seconds": seconds,
            "candidate_tokens": tokens, "us_per_token": 1e6 * seconds / tokens, **result}


def export_tree(ref: str, folder: Path) -> Path:
    """The product's code (kvrescue, grader) and the kit that drives it (kvrescue_testkit, where the ref has one) at
    git ref `ref`, exported to `folder` (made here)."""
    folder.mkdir()
    listed = subprocess.run(["git", "-C", str(ROOT), "ls-tree", "--name-only", ref], capture_output=True, text=True,
                            check=True).stdout.split()
    package = "kvrescue" if "kvrescue" in listed else "kvrescue_cli"  # its name before 6 December 2026
    kit = ["kvrescue_testkit"] if "kvrescue_testkit" in listed else []
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", ref, package, "grader", *kit],
                             capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(folder)], input=archive, check=True)
    return folder


# A tree from before the package was renamed: `kvrescue.X` imports give the same module objects as `kvrescue_cli.X`.
_OLD_NAME = """
import importlib, importlib.abc, importlib.util, sys
class OldName(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path=None, target=None):
        if name == "kvrescue" or name.startswith("kvrescue."):
            return importlib.util.spec_from_loader(name, self)
    def create_module(self, spec):
        return importlib.import_module("kvrescue_cli" + spec.name.removeprefix("kvrescue"))
    def exec_module(self, module):
        pass
sys.meta_path.insert(0, OldName())
"""


def _python(code: Path, call: str, args: list[str] | None = None, cwd: Path | None = None) -> subprocess.CompletedProcess:
    """A fresh Python process importing kvrescue (and the grader) from `code` first, then the benchmarks and this
    checkout's kit (kvrescue_testkit)."""
    if (code / "kvrescue_cli").is_dir():
        call = _OLD_NAME + call
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
           "PYTHONPATH": os.pathsep.join([str(code), str(ROOT)])}
    return subprocess.run([sys.executable, "-c", call, *(args or [])], capture_output=True, text=True, env=env,
                          cwd=cwd or code)


def measured_in(code: Path, bench: str, call: str) -> dict:
    """`bench.call` (a measurement returning a dict with the `code` it imported) in a fresh process importing
    kvrescue from `code` (a source tree); its result, checked to come from `code`."""
    done = _python(code, f"import {bench}, json; print(json.dumps({bench}.{call}))")
    if done.returncode != 0:
        raise SystemExit(f"{bench}: the run with {code} failed:\n{done.stderr[-3000:]}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    if Path(result["code"]).resolve() != code.resolve():
        raise SystemExit(f"{bench}: imported kvrescue from {result['code']}, not {code}")
    return result


def run_worker(code: Path, scorer: str, mode: str, args) -> dict:
    """`measure` in a fresh process importing kvrescue from `code` (a source tree)."""
    return measured_in(code, "benchmarks.speed.host_bench", f"measure({scorer!r}, {args.steps}, {args.problems}, {mode!r})")


def whole_run(code: Path, steps: int, problems: int, folder: Path) -> dict:
    """The issue's `kvrescue run` command with the code of `code`, timed from process start to exit;
    candidate tokens counted from the traces it wrote."""
    folder.mkdir(parents=True)
    bench = folder / "problems.jsonl"
    bench.write_text("".join(json.dumps({"problem": f"What is {i} + {2 * i}?", "answer": str(3 * i)}) + "\n"
                             for i in range(problems)))
    make = _python(code, "import host_bench, sys; print(*host_bench._checkpoints(__import__('pathlib').Path(sys.argv[1])))",
                   [str(folder)])
    if make.returncode != 0:
        raise SystemExit(f"host_bench: writing checkpoints with {code} failed:\n{make.stderr[-3000:]}")
    policy, prm = make.stdout.split()
    command = ["--method", "kvrescue", "--n", "8", "--batch", str(problems), "--synthetic-steps", f"32:{steps}",
               "--max-step-tokens", "32", "--bench", str(bench), "--base", policy, "--helper", policy, "--prm", prm,
               "--devices", "cpu", "--dtype", "float32", "--out", str(folder / "runs")]
    start = time.perf_counter()
    done = _python(code, "import sys; from kvrescue.cli import app; sys.argv[0] = 'kvrescue'; app()",
                   ["run", *command], cwd=folder)
    seconds = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"host_bench: kvrescue run with {code} failed:\n{done.stderr[-3000:]}")
    tokens = 0
    for traces in (folder / "runs").rglob("traces.jsonl"):
        for line in traces.read_text().splitlines():
            t = json.loads(line)["tokens"]
            tokens += t["base"] + t["helper"]
    return {"seconds": seconds, "candidate_tokens": tokens, "us_per_token": 1e6 * seconds / tokens}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", help="a git ref to measure beside this tree, e.g. e1e97a2")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3, help="synthetic steps per problem")
    parser.add_argument("--problems", type=int, default=64)
    parser.add_argument("--whole", type=int, metavar="STEPS", help="also time the whole `kvrescue run` (32:STEPS)")
    parser.add_argument("--profile", action="store_true", help="print a cProfile of this tree's run without scorer")
    args = parser.parse_args()
    trees = {"this tree": ROOT}
    report: dict = {"cells": [], "whole": []}
    with tempfile.TemporaryDirectory() as tmp:
        if args.baseline:
            trees[args.baseline] = export_tree(args.baseline, Path(tmp) / "baseline")
        best: dict[tuple[str, str], dict] = {}
        for _ in range(args.rounds):
            for scorer in ("prm", "none"):
                for name, code in trees.items():
                    result = run_worker(code, scorer, "wall", args)
                    key = (name, scorer)
                    if key not in best or result["us_per_token"] < best[key]["us_per_token"]:
                        best[key] = result
        split = {(name, scorer): run_worker(code, scorer, "ops", args)
                 for scorer in ("prm", "none") for name, code in trees.items()}
        whole = {}
        if args.whole:
            for name, code in trees.items():
                whole[name] = whole_run(code, args.whole, args.problems, Path(tmp) / f"whole-{len(whole)}")
        cprofile = run_worker(ROOT, "none", "cprofile", args)["profile"] if args.profile else ""
    print(f"{'code':>12}  scorer  {'wall':>7}  {'host':>7}  {'ops':>7}  ops/token  (µs per candidate token; "
          "host = profiled wall - aten op time)", file=sys.stderr)
    for (name, scorer), result in best.items():
        s = split[(name, scorer)]
        tokens = s["candidate_tokens"]
        host = 1e6 * (s["seconds"] - s["op_seconds"]) / tokens
        ops = 1e6 * s["op_seconds"] / tokens
        row = {"code": name, "scorer": scorer, "wall_us": round(result["us_per_token"], 2),
               "host_us": round(host, 2), "op_us": round(ops, 2), "ops_per_token": round(s["ops"] / tokens, 4),
               "candidate_tokens": result["candidate_tokens"], "seconds": round(result["seconds"], 2),
               "wall_ratio_to_this_tree": round(result["us_per_token"] / best[("this tree", scorer)]["us_per_token"], 2),
               "top_ops_ms": s["top_ops"]}
        report["cells"].append(row)
        print(f"{name:>12}  {scorer:<6}  {row['wall_us']:7.2f}  {host:7.2f}  {ops:7.2f}  {row['ops_per_token']:9.4f}  "
              f"({result['candidate_tokens']:.0f} tokens, {result['seconds']:.1f} s, wall x{row['wall_ratio_to_this_tree']:.2f})",
              file=sys.stderr)
    for name, result in whole.items():
        report["whole"].append({"code": name, "us_per_token": round(result["us_per_token"], 2),
                                "candidate_tokens": result["candidate_tokens"], "seconds": round(result["seconds"], 1)})
        print(f"{name:>12}  whole `kvrescue run` 32:{args.whole}: {result['us_per_token']:7.2f} µs/candidate token "
              f"({result['candidate_tokens']} tokens, {result['seconds']:.1f} s)", file=sys.stderr)
    mine = [r for r in report["cells"] if r["code"] == "this tree"]
    verdicts = [f"host ≤ {AIM_HOST_US:g} µs ({r['scorer']}): {'met' if r['host_us'] <= AIM_HOST_US else 'NOT met'} "
                f"({r['host_us']:.2f})" for r in mine]
    if "this tree" in whole:
        w = whole["this tree"]["us_per_token"]
        verdicts.append(f"whole run ≤ {AIM_WHOLE_US:g} µs: {'met' if w <= AIM_WHOLE_US else 'NOT met'} ({w:.2f})")
    print("aims here: " + "; ".join(verdicts), file=sys.stderr)
    for name, scorer in split:
        print(f"top aten ops by self CPU time, {name}, scorer={scorer} (name, calls, ms): {split[(name, scorer)]['top_ops']}",
              file=sys.stderr)
    if cprofile:
        print(cprofile, file=sys.stderr)
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
