"""gpu_check's `memory` section: a finished cell frees what it allocated by reference counting alone. Two kvrescue
cells (random models, synthetic steps), one after the other, decode with the cyclic garbage collector off; the
device's allocated bytes are read before the first, after it and after the second. What the second cell adds to what
the first left is a leak (a cycle among a cell's objects would keep its caches until a full collection, and every
cell of a grid would add its own); what the first left and the second does not add to is a one-time workspace (cuBLAS
and cuBLASLt keep one per handle and stream on a GPU: 32 MiB + 1 MiB on Hopper), which the check reports and does not
fail on. On a CPU the cells run on fake CUDA (`kvrescue_testkit.fake_cuda`), whose allocated bytes are those of its fake
tensors."""

from __future__ import annotations

import gc
from contextlib import nullcontext

import torch

from benchmarks.gpu_check.gpu_check_problems import ROLES, synthetic_grid
from benchmarks.gpu_check.gpu_check_record import Check
from benchmarks.gpu_check.gpu_check_setup import QWEN25_05B, TINY, random_loaded
from kvrescue.cell_plan import Cell
from kvrescue.cell_runners import build_cell
from kvrescue.decoding import decode_cell
from kvrescue_testkit.dry_run import TokenScript, fake_model
from kvrescue_testkit.fake_cuda import FakeCuda
from kvrescue_testkit.random_checkpoints import build_tokenizer


def left_by_cells(before: int, after_first: int, after_second: int) -> dict:
    """What two cells left allocated: the second's growth, a leak (ok without; each cell would leak as much), and the
    one-time workspace, what the first left beyond that."""
    growth = after_second - after_first
    return {"bytes_before": before, "bytes_after_first": after_first, "bytes_after_second": after_second,
            "workspace_bytes": max(after_first - before - max(growth, 0), 0), "growth_bytes": growth, "ok": growth <= 0}


def cell_memory(device: str, dtype: torch.dtype, tiny: bool, plan: dict) -> dict:
    """Bytes allocated on the device before, between and after two kvrescue cells of 2 problems, the collector off."""
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
            allocated = [torch.cuda.memory_allocated(on)]
            for seed in (0, 1):
                cell = Cell(problems, "kvrescue", plan["budget"], plan["n"], seed)
                plan_of_cell = options.plan_of(cell)
                decode_cell(plan_of_cell, cell, build_cell(plan_of_cell, models), iter(problems.problems),
                            lambda trace, _: finished.append(trace))
                allocated.append(torch.cuda.memory_allocated(on))
        finally:
            gc.enable()
    return {"problems": len(finished), "cells": 2, **left_by_cells(*allocated), "fake_cuda": fake}


def memory_section(check: Check, device: str, dtype: torch.dtype, tiny: bool, plan: dict) -> None:
    check.measure("memory", {"method": "kvrescue", "shape": "tiny" if tiny else "Qwen2.5-0.5B"}, check.deadline(1.0),
                  lambda: cell_memory(device, dtype, tiny, plan))
