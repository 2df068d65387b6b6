"""A 2-group CPU `kvrescue run` (two Ray actors) beside busy processes, its actors at Ray's default niceness 15
against 0 (`RAY_worker_niceness`, which kvrescue's own Ray start sets to 0 unless it is set).

    .venv/bin/python benchmarks/speed/niceness_bench.py [--busy 2] [--rounds 2] [--problems 8]

Tiny random checkpoints (the tests' shapes), kvrescue with N = 2 and a few short steps, `--devices cpu,cpu`. Each
round runs both niceness values, in alternating order, as whole `kvrescue run` processes (Ray's start and the
models' loading included), beside `--busy` processes spinning at niceness 0 (another job on a shared machine). Prints
each run's wall seconds and the ratio of the best of each (JSON on stdout).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from kvrescue_testkit.random_checkpoints import write_random_checkpoint

TINY = dict(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128, init_std=0.1)
KVRESCUE = str(Path(sys.executable).with_name("kvrescue"))
RUN = ["--method", "kvrescue", "--n", "2", "--max-step-tokens", "12", "--max-steps", "5", "--context-cap", "320",
       "--budget", "16", "--batch", "1", "--devices", "cpu,cpu"]


def timed_run(niceness: int, folder: Path, problems: Path, models: list[str], out: Path) -> float:
    """Wall seconds of one `kvrescue run` whose Ray actors start at `niceness`."""
    env = {**os.environ, "RAY_worker_niceness": str(niceness), "OMP_NUM_THREADS": "1"}
    started = time.perf_counter()
    done = subprocess.run([KVRESCUE, "run", "--bench", str(problems), *models, *RUN, "--out", str(out)], env=env,
                          capture_output=True, cwd=folder)
    wall = time.perf_counter() - started
    if done.returncode:
        raise SystemExit(f"kvrescue run failed: {done.stderr.decode()[-2000:]}")
    return wall


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--busy", type=int, default=2, help="spinning processes beside the run")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--problems", type=int, default=8)
    args = parser.parse_args()
    folder = Path(tempfile.mkdtemp(prefix="niceness_bench-"))
    models = []
    for role, arch, seed in (("base", "qwen2", 1), ("helper", "llama", 2), ("prm", "prm", 3)):
        models += [f"--{role}", str(write_random_checkpoint(folder / arch, arch, seed=seed, **TINY))]
    problems = folder / "tiny.jsonl"
    problems.write_text("".join(json.dumps({"question": f"What is {a} + 2? Let x be the answer.", "answer": str(a + 2)})
                                + "\n" for a in range(args.problems)))
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.busy)]
    walls: dict[int, list[float]] = {15: [], 0: []}
    try:
        for round_ in range(args.rounds):
            for niceness in (15, 0) if round_ % 2 == 0 else (0, 15):
                walls[niceness].append(timed_run(niceness, folder, problems, models,
                                                 folder / f"out-{niceness}-{round_}"))
                Console(stderr=True).print(f"round {round_ + 1}: niceness {niceness}: {walls[niceness][-1]:.1f} s")
    finally:
        for spinner in spinners:
            spinner.kill()
            spinner.wait()
        shutil.rmtree(folder, ignore_errors=True)
    table = Table(title=f"niceness_bench: 2 Ray actors on the CPU, {args.problems} problems, beside {args.busy} busy "
                        f"processes, {os.cpu_count()} cores, wall s")
    for column in ("actors' niceness", "runs", "best", "15 / 0 (best)"):
        table.add_column(column, justify="right")
    for niceness, times in walls.items():
        table.add_row(str(niceness), ", ".join(f"{t:.1f}" for t in times), f"{min(times):.1f}",
                      f"{min(walls[15]) / min(walls[0]):.2f}" if niceness == 0 else "")
    Console(stderr=True).print(table)
    print(json.dumps({"busy": args.busy, "problems": args.problems, "walls": walls,
                      "best_15_over_0": min(walls[15]) / min(walls[0])}, indent=1))


if __name__ == "__main__":
    main()
