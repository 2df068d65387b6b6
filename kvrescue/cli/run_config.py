"""`kvrescue run --config` and `--preset`: where `run`'s options come from besides the command line, and the
grid axes they give."""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Optional, get_args, get_type_hints

import typer

from kvrescue.cli.shared import comma_list, fail
from kvrescue.config_file import read_grid_file
from kvrescue.errors import InputError
from kvrescue.run_options import GridAxes
from kvrescue.scorers import HELPER_LOGLIK

GRIDS = "kvrescue.grids"  # ctx.meta key: a --config file's [[grid]] tables


def run_option_kinds(ctx: typer.Context) -> tuple[dict[str, type], dict[str, str]]:
    """Each `run` option's type, and every grid-file key (long names without dashes, parameter names) -> option."""
    hints = get_type_hints(inspect.unwrap(ctx.command.callback))
    kinds, keys = {}, {}
    for param in ctx.command.params:
        if param.name == "config" or not param.opts:
            continue
        hint = hints[param.name]
        kinds[param.name] = next((a for a in get_args(hint) if a is not type(None)), hint)
        keys |= {param.name: param.name, **{o.lstrip("-"): param.name for o in param.opts if o.startswith("--")}}
    return kinds, keys


def grid_file(ctx: typer.Context, path: Optional[Path]) -> Optional[Path]:
    """--config: the file's options become the defaults of the options the command line does not give."""
    if path is None:
        return None
    try:
        grid = read_grid_file(path, *run_option_kinds(ctx))
        for param in ctx.command.params:
            for value in [grid.options.get(param.name), *(g.get(param.name) for g in grid.grids)]:
                if value is None:
                    continue
                try:
                    param.process_value(ctx, value)
                except typer.BadParameter as err:
                    raise InputError(f"{path}: key '{param.name.replace('_', '-')}': {err.message}") from None
    except InputError as err:
        fail(err)
    ctx.default_map = {**(ctx.default_map or {}), **grid.options}
    ctx.meta[GRIDS] = grid.grids
    return path


def grids_of(ctx: typer.Context, axes: dict[str, str]) -> tuple[GridAxes, ...]:
    """The [[grid]] tables' axes, each missing axis (and every axis the command line gives) from `axes`."""
    given = {a for a in axes if ctx.get_parameter_source(a).name == "COMMANDLINE"}
    return tuple(axes_of({**axes, **{a: v for a, v in table.items() if a not in given}})
                 for table in ctx.meta.get(GRIDS, []))


def axes_of(values: dict[str, str]) -> GridAxes:
    """One grid's axes from its comma lists (`--bench`, `--method`, `--budget`, `--n`, `--seed`)."""
    return GridAxes(comma_list(values["bench"], str, "--bench"), comma_list(values["method"], str, "--method"),
                    comma_list(values["budget"], int, "--budget"), comma_list(values["n"], int, "--n"),
                    comma_list(values["seed"], int, "--seed"))


# scripts/demo.sh's setting, a problem in about a minute on a CPU: SmolLM2's 192-token steps, 2 of them in a context
# of 1,024 tokens, fp32 (the same tokens on every CPU) and its calibrated repetition test (docs/benchmarks.md)
CPU_DEMO = {"budget": "16", "n": "2", "max_steps": 2, "max_step_tokens": 192, "context_cap": 1024, "cmp_chars": 400,
            "tau_cmp": 0.35, "dtype": "float32", "devices": "cpu"}
PRESET_HELP = (f"cpu-demo: SmolLM2-135M from PyPI as base and helper, the {HELPER_LOGLIK} scorer, and the demo's "
               + ", ".join(f"--{k.replace('_', '-')} {v}" for k, v in CPU_DEMO.items())
               + " (options given, here or in --config, win)")


def preset_defaults(ctx: typer.Context, value: Optional[str]) -> Optional[str]:
    """--preset: its settings become the defaults of the options neither the command line nor --config gives."""
    if value is None:
        return None
    if value != "cpu-demo":
        fail(InputError(f"unknown preset '{value}': the only preset is cpu-demo"))
    ctx.default_map = {**CPU_DEMO, **(ctx.default_map or {})}
    return value
