"""`kvrescue cost`: KV memory and decode FLOPs (the paper's Appendix D) and the per-device plan, on stdout."""

from __future__ import annotations

import sys
from typing import Optional

import typer
from rich.table import Table

from kvrescue.cli.shared import DEFAULT_MODELS, one_line_errors, stdout
from kvrescue.errors import InputError
from kvrescue.shapes import BUFFER, MAX_CONTEXT


@one_line_errors
def cost(
    base: str = typer.Option(DEFAULT_MODELS["base"], help="base model: Hub id, folder or config.json"),
    helper: str = typer.Option(DEFAULT_MODELS["helper"], help="helper model: Hub id, folder or config.json"),
    prm: Optional[str] = typer.Option(None, help="PRM (Hub id, folder or config.json) to count in the per-device plan"),
    budget: int = typer.Option(64, min=1, max=1 << 24, help=f"KV budget B (the cache peaks at B' = B + {BUFFER})"),
    context: int = typer.Option(MAX_CONTEXT, min=1, max=1 << 24, help="context length L"),
    n: int = typer.Option(8, min=1, max=1 << 10, help="candidates per model"),
    alpha: float = typer.Option(2.9, min=0.0, help="eviction overhead in units of B' attention (paper: 2.9)"),
    tp: int = typer.Option(1, "--tp", min=1, max=1 << 10, help="devices each model is sharded over (per-device plan)"),
    batch: int = typer.Option(1, min=1, max=1 << 20, help="problems decoded at once (per-device plan)"),
    format: str = typer.Option("table", "--format", help="table (rich) or json; on stdout"),
) -> None:
    """KV memory and decode FLOPs of the evicted base and the full helper (the paper's Appendix D), and what
    each device allocates under --tp for `batch` problems of KV-Rescue at once (the planner `run` uses; bf16, on a
    GPU with CUDA graphs and torch attention)."""
    from kvrescue.cost import Architecture, cost_json, cost_rows, estimate
    from kvrescue.memory_plan import CellShape, DeviceKind, plan_cell, plan_json, plan_rows

    if format not in ("table", "json"):
        raise InputError(f"unknown --format '{format}': use table or json")
    archs = {role: Architecture.of_model(name)
             for role, name in (("base", base), ("helper", helper), ("prm", prm)) if name}
    result = estimate(archs["base"], archs["helper"], budget, context, n, alpha)
    cell = CellShape(batch, n, "bounded", budget, True, "prm" if prm else None, context_cap=context)
    plan = plan_cell(archs, cell, DeviceKind(cuda=True, dtype_bytes=archs["base"].dtype_bytes, cuda_graphs=True, tp=tp))
    if format == "json":
        sys.stdout.buffer.write(cost_json(result, plan_json(plan, tp)))
        return
    table = Table(title=f"cost: base {base}, helper {helper}, B={budget}, L={context}, N={n}")
    table.add_column("quantity", overflow="fold")
    table.add_column("value", justify="right", no_wrap=True)
    for name, value in cost_rows(result) + plan_rows(plan, tp):
        table.add_row(name, value)
    stdout.print(table)
