"""`kvrescue run` reads its defaults from their owners, torch-free (the options by concern in `run_options`, the
sampling parameters, the detector's config); `kvrescue cost`'s are literals: each equals its owner's."""

import dataclasses
import inspect

from kvrescue import cli
from kvrescue.cost import estimate
from kvrescue_testkit.dry_run import dry_run
from kvrescue.engine.sampling import SamplingParams
from kvrescue.devices import CPU, GPU
from kvrescue.grid import GridOptions
from kvrescue.run_options import DEFAULT_BATCH


def defaults(command) -> dict[str, object]:
    """A typer command's option defaults by parameter name."""
    return {name: p.default.default for name, p in inspect.signature(command).parameters.items()
            if p.default is not inspect.Parameter.empty}  # (run's typer context)


def test_run_takes_the_grid_options_and_sampling_defaults():
    run = defaults(cli.run)
    owned = {f.name: f.default for f in dataclasses.fields(GridOptions) if f.default is not dataclasses.MISSING}
    resolved = {"prompt", "prm_recipe", "dtype", "devices", "also_grade"}  # `auto` / a comma list, resolved by `run`
    shared = set(run) & set(owned) - resolved
    assert {"buffer", "cuda_graphs", "engine", "grader", "prm_format", "tp", "vllm_memory", "limit"} <= shared
    assert {name: run[name] for name in shared} == {name: owned[name] for name in shared}
    assert {name: run[name] for name in ("temperature", "top_p", "top_k")} == dataclasses.asdict(SamplingParams())
    batch_help = inspect.signature(cli.run).parameters["batch"].default.help
    assert f"{DEFAULT_BATCH[GPU]} on a Ray cluster, {DEFAULT_BATCH[CPU]} on CPU" in batch_help


def test_cost_and_the_dry_run_price_the_cell_run_decodes_by_default():
    run, cost = defaults(cli.run), defaults(cli.cost)
    paper = (int(run["budget"]), int(run["n"]), run["context_cap"])
    assert (cost["budget"], cost["n"], cost["context"]) == paper
    priced = inspect.signature(estimate).parameters
    assert (priced["budget"].default, priced["n"].default, priced["context"].default) == paper
    dry = inspect.signature(dry_run).parameters
    assert (dry["budget"].default, dry["n"].default) == paper[:2]
