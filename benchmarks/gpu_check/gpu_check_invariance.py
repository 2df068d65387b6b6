"""gpu_check's `invariance` section: does `--deterministic` make each problem's traces independent of `--batch` on
this device? On a GPU its kernel settings (flash-attn with one KV split, cuBLAS without split-K) are untested until
this runs (docs/reproducibility.md). `kvrescue run`, a fresh process per run (cuBLAS reads its workspace settings
at a process's first product), decodes 8 problems of kvrescue on a random Qwen2 checkpoint written for the section
at `--batch 1` and `--batch 8`, without and then with `--deterministic`, in the check's dtype; each record counts
the problems whose traces (committed steps, every candidate's text, the output) agree. With `--tiny`: 4 problems at
`--batch 1` and `--batch 4`, with `--deterministic` only. On a GPU older than Hopper, `--deterministic` is refused
and its record says so."""

from __future__ import annotations

import subprocess
import sys
import tempfile
import time
from pathlib import Path

import orjson
import torch

from benchmarks.gpu_check.gpu_check_record import Check
from kvrescue_testkit.random_checkpoints import write_random_checkpoint

PROBLEMS = {True: 4, False: 8}  # by --tiny; each run's problems are all at once at the larger --batch
SHAPES = {True: dict(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128),  # --tiny
          False: dict(hidden_size=512, num_layers=4, num_heads=8, num_kv_heads=2, intermediate_size=1024)}
RUN = ["--method", "kvrescue", "--n", "2", "--budget", "16", "--max-steps", "2", "--max-step-tokens", "16",
       "--context-cap", "256", "--prm", "helper-loglik"]


def run_traces(model: Path, problems: Path, out: Path, device: str, dtype: str, batch: int, deterministic: bool,
               timeout_s: float) -> list[tuple]:
    """Each problem's trace, as compared (idx, steps, candidates' texts, output), of one `kvrescue run`."""
    command = [sys.executable, "-c", "import sys; from kvrescue.cli import app; sys.argv[0] = 'kvrescue'; app()",
               "run", "--base", str(model), "--helper", str(model), "--bench", str(problems), *RUN, "--devices", device,
               "--dtype", dtype, "--batch", str(batch), "--out", str(out), *(["--deterministic"] if deterministic else [])]
    done = subprocess.run(command, capture_output=True, timeout=max(timeout_s, 1.0))
    if done.returncode != 0:
        raise RuntimeError(done.stderr.decode().strip().splitlines()[-1])
    (path,) = out.glob("*/kvrescue-*/traces.jsonl")
    traces = [orjson.loads(line) for line in path.read_bytes().splitlines()]
    return sorted((t["idx"], [(s["text"], s["source"]) for s in t["steps"]],
                   [[c["text"] for c in step] for step in t["candidates"]], t["output"]) for t in traces)


def agreement(device: str, dtype: torch.dtype, tiny: bool, deterministic: bool, stop_at: float) -> dict:
    """How many problems have the same traces at `--batch 1` and with all of them in one batch."""
    count = PROBLEMS[tiny]
    with tempfile.TemporaryDirectory(prefix="gpu_check-invariance-") as tmp:
        root = Path(tmp)
        model = write_random_checkpoint(root / "model", "qwen2", **SHAPES[tiny], seed=5)
        problems = root / "sums.jsonl"
        problems.write_bytes(b"".join(orjson.dumps({"question": f"What is {a} + {3 * a}?", "answer": str(4 * a)}) + b"\n"
                                      for a in range(1, count + 1)))
        name = str(dtype).removeprefix("torch.")
        runs = [run_traces(model, problems, root / f"batch-{b}", device, name, b, deterministic,
                           stop_at - time.perf_counter()) for b in (1, count)]
    agree = sum(a == b for a, b in zip(*runs))
    return {"agree": agree, "ok": agree == count if deterministic else None}


def invariance_section(check: Check, device: str, dtype: torch.dtype, tiny: bool) -> None:
    """With --tiny (fp32 on a CPU, where the tiny model's rows agree either way) only the --deterministic pair."""
    for deterministic in (True,) if tiny else (False, True):
        check.measure("invariance", {"deterministic": deterministic, "problems": PROBLEMS[tiny],
                                     "batches": [1, PROBLEMS[tiny]],
                                     "shape": "tiny" if tiny else "hidden 512 x 4 layers"},
                      check.deadline(1.0), lambda: agreement(device, dtype, tiny, deterministic, check.deadline(1.0)),
                      interrupt=False)
