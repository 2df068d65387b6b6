"""gpu_check's `e2e` section: the path a user takes on a new GPU, each command in a process of its own, as typed.

Random checkpoints are written to a scratch folder (the base in Qwen2.5-Math-1.5B's shape, the helper and the PRM in
Qwen2.5-0.5B's, all with the same small tokenizer; tiny ones with `--tiny`), then:

- `kvrescue run --plan` of the grid below (whether it fits);
- `kvrescue run` of bon, kvrescue and full on MATH500's first problems with synthetic steps, at a fixed `--batch` and
  at `--batch auto`: problems/min of each method (its summary.json's throughput), and the run's memory plan against
  the GPU's peak allocated and reserved bytes (`gpu_check_cli` records them at the process's end);
- the fixed-batch run again: its cells are complete, so it must load no model;
- `kvrescue report` and `kvrescue view` of the two runs' folders.

Each command has a timeout within the section's budget; one that fails or runs out of time is recorded with the end
of its error output, and the section goes on.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import orjson
import torch

from benchmarks.gpu_check.gpu_check_record import Check, peaks
from kvrescue_testkit.random_checkpoints import write_random_checkpoint

CLI = Path(__file__).with_name("gpu_check_cli.py")
QWEN25_MATH_15B = dict(hidden_size=1536, num_layers=28, num_heads=12, num_kv_heads=2, intermediate_size=8960,
                       vocab_size=151936)
QWEN25_05B = dict(hidden_size=896, num_layers=24, num_heads=14, num_kv_heads=2, intermediate_size=4864,
                  vocab_size=151936)
TINY = dict(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128)
SHAPES = {False: {"base": QWEN25_MATH_15B, "helper": QWEN25_05B, "prm": QWEN25_05B},
          True: {"base": TINY, "helper": TINY, "prm": TINY}}
GRID = {False: ["--limit", "32", "--n", "8", "--budget", "64", "--synthetic-steps", "32:4"],
        True: ["--limit", "4", "--n", "2", "--budget", "16", "--synthetic-steps", "4:2"]}
FIXED_BATCH = {False: "16", True: "2"}
# --batch auto plans from the device's free memory; on a CPU that is the RAM, where tiny models would get thousands of
# problems' caches: there, as a user of a small machine would, the plan gets a small device
AUTO_MEMORY = {False: [], True: ["--device-memory", "1.5GiB"]}  # 0.5 GiB after the 1 GiB headroom
# shares of the section's time left when each command starts
RUN_SHARE, SMALL_SHARE = 0.45, 0.25


def kvrescue(args: list[str], measures: Path, timeout_s: float) -> dict:
    """One `kvrescue` command in its own process (through `gpu_check_cli`): its exit status, seconds, the last lines
    of its error output when it failed, and what `gpu_check_cli` measured."""
    measures.unlink(missing_ok=True)
    start = time.perf_counter()
    try:
        done = subprocess.run([sys.executable, str(CLI), *args], capture_output=True, timeout=max(timeout_s, 1.0),
                              env={**os.environ, "GPU_CHECK_MEASURES": str(measures)})
        status, errors = done.returncode, done.stderr.decode(errors="replace")
    except subprocess.TimeoutExpired as err:
        status, errors = None, f"timed out after {timeout_s:.0f} s; " + (err.stderr or b"").decode(errors="replace")
    result: dict = {"command": "kvrescue " + " ".join(args), "exit": status, "seconds": time.perf_counter() - start}
    if status != 0:
        result["error"] = "\n".join(errors.strip().splitlines()[-3:])[-600:]
    if measures.exists():
        found = json.loads(measures.read_text())
        result.update(models_loaded=found["models_loaded"], batch=found["batch"], planned_bytes=found["planned_bytes"])
        if "peak_allocated_bytes" in found:
            result.update(peaks(found["peak_allocated_bytes"], found["peak_reserved_bytes"], found["planned_bytes"]))
    return result


def cell_rates(out: Path) -> dict:
    """Problems and problems/min of each method's cell under `out` (its summary.json)."""
    rates = {}
    for path in sorted(out.glob("*/*/summary.json")):
        summary = orjson.loads(path.read_bytes())
        rates[summary["method"]] = {"problems": summary["problems"], "problems_per_min": summary["throughput_per_min"]}
    return rates


def e2e_section(check: Check, device: str, dtype: torch.dtype, tiny: bool, end: float) -> None:
    """Every step of the path, recorded as it ends; none started past `end`, each command's timeout within it."""
    name = str(dtype).removeprefix("torch.")
    with tempfile.TemporaryDirectory(prefix="gpu_check-e2e-") as scratch:
        root = Path(scratch)
        models: dict[str, Path] = {}

        def write() -> dict:
            for seed, (role, shape) in enumerate(SHAPES[tiny].items()):
                models[role] = write_random_checkpoint(root / role, "prm" if role == "prm" else "qwen2", **shape,
                                                       seed=seed, dtype=dtype, device=device)
            return {"bytes": sum(f.stat().st_size for f in root.rglob("*.safetensors"))}

        check.measure("e2e", {"step": "checkpoints", "shape": "tiny" if tiny else "Qwen2.5-Math-1.5B / 0.5B / 0.5B"},
                      end, write, interrupt=False)
        if len(models) < 3:
            return
        common = ["--base", str(models["base"]), "--helper", str(models["helper"]), "--prm", str(models["prm"]),
                  "--bench", "math500", "--method", "bon,kvrescue,full", *GRID[tiny], "--devices", device,
                  "--dtype", name]
        measures = root / "measures.json"

        def step(what: str, args: list[str], share: float, extra=None) -> None:
            """One command; `extra`: what else to record of it once it succeeded."""
            def run() -> dict:
                result = kvrescue(args, measures, share * (end - time.perf_counter()))
                return {**result, **(extra(result) if extra is not None and result["exit"] == 0 else {})}
            check.measure("e2e", {"step": what}, end, run, interrupt=False)

        fixed = ["--batch", FIXED_BATCH[tiny], "--out", str(root / "fixed")]
        auto = ["--batch", "auto", *AUTO_MEMORY[tiny], "--out", str(root / "auto")]
        step("plan", ["run", *common, *fixed, "--plan"], SMALL_SHARE)
        step("run", ["run", *common, *fixed], RUN_SHARE, lambda _: {"cells": cell_rates(root / "fixed")})
        step("run", ["run", *common, *auto], RUN_SHARE, lambda _: {"cells": cell_rates(root / "auto")})
        step("rerun", ["run", *common, *fixed], SMALL_SHARE, lambda done: {"ok": done.get("models_loaded") == 0})
        step("report", ["report", str(root / "fixed"), str(root / "auto"), "--format", "json"], SMALL_SHARE)
        page = root / "runs.html"
        step("view", ["view", str(root / "fixed"), str(root / "auto"), "--out", str(page)], 1.0,
             lambda _: {"page_bytes": page.stat().st_size})
