"""gpu_check's `devices` section (two or more GPUs visible): a run given `--devices cuda:N` computes on GPU N. The
in-process executor (`in_process.InProcessGroup`, what `kvrescue run` builds for one device group) loads small random
checkpoints, written to a scratch folder, on the last visible GPU and decodes a kvrescue cell of 2 problems there;
every model parameter must lie on that device, and no other visible GPU may gain allocated bytes."""

from __future__ import annotations

import tempfile
from dataclasses import replace
from pathlib import Path

import torch

from benchmarks.gpu_check.gpu_check_problems import synthetic_grid
from benchmarks.gpu_check.gpu_check_record import Check
from kvrescue.in_process import InProcessGroup
from kvrescue.cell_plan import Cell
from kvrescue_testkit.random_checkpoints import write_random_checkpoint

SHAPE = dict(hidden_size=256, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=512)


def device_mapping(device: str, plan: dict) -> dict:
    """Where the executor for group (`device`,) puts its models, and the bytes each visible GPU gained meanwhile."""
    visible = range(torch.cuda.device_count())
    before = {i: torch.cuda.memory_allocated(i) for i in visible}
    with tempfile.TemporaryDirectory(prefix="gpu_check-devices-") as scratch:
        base = write_random_checkpoint(Path(scratch) / "base", "qwen2", **SHAPE)
        prm = write_random_checkpoint(Path(scratch) / "prm", "prm", **SHAPE)
        options, problems = synthetic_grid(plan, device, torch.bfloat16, 2)
        options = replace(options, models={"base": str(base), "helper": str(base), "prm": str(prm)},
                          dtype="bfloat16", devices=(device,))
        executor = InProcessGroup(options, (device,))
        try:
            traces: list = []
            executor.decode_cell(Cell(problems, "kvrescue", plan["budget"], plan["n"], 0), problems.problems,
                            lambda trace, _: traces.append(trace))
            placed = {role: sorted({str(p.device) for p in model.net.parameters()})
                      for role, model in executor.models.items()}
            gained = {f"cuda:{i}": torch.cuda.memory_allocated(i) - before[i] for i in visible}
        finally:
            executor.close()
    others = [d for d in gained if d != device]
    return {"problems": len(traces), "models_on": placed, "bytes_gained": gained,
            "ok": all(p == [device] for p in placed.values()) and all(gained[d] <= 0 for d in others)}


def devices_section(check: Check, device: str, plan: dict) -> None:
    count = torch.cuda.device_count() if device.startswith("cuda") else 0
    record = {"device": f"cuda:{count - 1}" if count >= 2 else None}
    skip = None if count >= 2 else "needs two or more visible GPUs"
    check.measure("devices", record, check.deadline(1.0), lambda: device_mapping(record["device"], plan), skip)
