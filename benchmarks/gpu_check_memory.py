"""gpu_check's `memory` section: a finished cell frees what it allocated by reference counting alone. One kvrescue
cell (random models, synthetic steps) decodes with the cyclic garbage collector off; the device's allocated bytes
after it, against before it, must be back where they were (a cycle among the cell's objects would keep its caches
until a full collection, and the grid's next cell would allocate on top of them). On a CPU the cell runs on fake
CUDA (`kvrescue_cli.fake_cuda`), whose allocated bytes are those of its fake tensors."""

from __future__ import annotations

import gc
from contextlib import nullcontext

import torch

from gpu_check_problems import ROLES, synthetic_grid
from gpu_check_record import Check
from gpu_check_setup import QWEN25_05B, TINY, random_loaded
from kvrescue_cli.cell_engine import build_cell
from kvrescue_cli.decoding import decode
from kvrescue_cli.dry_run import TokenScript, fake_model
from kvrescue_cli.fake_cuda import FakeCuda
from kvrescue_cli.grid import Cell
from kvrescue_cli.random_checkpoints import build_tokenizer


def cell_memory(device: str, dtype: torch.dtype, tiny: bool, plan: dict) -> dict:
    """Bytes allocated on the device after one kvrescue cell of 2 problems against before it, the collector off."""
    tokenizer = build_tokenizer(512)
    fake = not device.startswith("cuda")
    on = "cuda:0" if fake else device
    shape = TINY if tiny else QWEN25_05B
    with FakeCuda(host_reads=TokenScript(tokenizer.encode(" x", add_special_tokens=False)[0])) if fake else nullcontext():
        models = {role: fake_model(shape, role, tokenizer, dtype, on) if fake else
                  random_loaded(shape, on, dtype, 30 + i, tokenizer, role) for i, role in enumerate(ROLES)}
        options, problems = synthetic_grid(plan, on, dtype, 2)
        finished: list = []
        gc.collect()
        gc.disable()
        try:
            before = torch.cuda.memory_allocated(on)
            cell = Cell(problems, "kvrescue", plan["budget"], plan["n"], 0)
            decode(options, cell, build_cell(options, cell, models), iter(problems.problems),
                   lambda trace, _: finished.append(trace))
            left = torch.cuda.memory_allocated(on) - before
        finally:
            gc.enable()
    return {"problems": len(finished), "bytes_before": before, "bytes_left": left, "ok": left == 0,
            "fake_cuda": fake}


def memory_section(check: Check, device: str, dtype: torch.dtype, tiny: bool, plan: dict) -> None:
    check.measure("memory", {"method": "kvrescue", "shape": "tiny" if tiny else "Qwen2.5-0.5B"}, check.deadline(1.0),
                  lambda: cell_memory(device, dtype, tiny, plan))
