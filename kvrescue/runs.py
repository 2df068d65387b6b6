"""`kvrescue run`: a grid of configurations over problem sets, models loaded once, one run folder per cell."""

from __future__ import annotations

import time
from contextlib import suppress
from dataclasses import replace

from rich.progress import Progress

from kvrescue import in_process, workers
from kvrescue.auto_options import resolve_prm_recipe, resolve_prompt
from kvrescue.cell_plan import Cell, CellPlan, ScorerPlan
from kvrescue.data import data_dir, load_problems
from kvrescue.device_plan import plan_for_device
from kvrescue.engine.sampling import STREAM_VERSION
from kvrescue.errors import InputError
from kvrescue.grid import GridOptions, bench_identity
from kvrescue.methods import METHODS
from kvrescue.model_config import model_revision
from kvrescue.scorers import PRM
from kvrescue.outputs import (
    ModelRef, RunConfig, RunFolder, RunFolderError, Summary, Trace, problem_checksum, run_dir, same_cell_elsewhere,
)
from kvrescue.outputs.summary import run_accuracy
from kvrescue.progress import CellRate
from kvrescue.run_options import RunIO
from kvrescue.search import DecodeProgress


def cell_config(options: GridOptions, cell: Cell) -> RunConfig:
    """The run folder identity of one cell: how it runs from its `CellPlan`, its settings from the grid's."""
    plan, spec = options.plan_of(cell), METHODS[cell.method]
    roles, s = plan.roles(), options.settings
    evictor_params = plan.recorded_params  # None: the defaults
    revisions = {role: options.revisions[role] for role in sorted(roles) if role in options.revisions}
    return RunConfig(
        bench=bench_identity(cell.problems),
        method=cell.method,
        budget=cell.budget,
        n=cell.n,
        evictor=plan.evictor,
        seed=cell.seed,
        models={role: ModelRef(options.models[role], model_revision(options.models[role])) for role in sorted(roles)},
        scorer=plan.scorer.kind,
        synthetic=s.synthetic_steps is not None,
        settings={
            "temperature": s.sampling.temperature, "top_p": s.sampling.top_p, "top_k": s.sampling.top_k,
            "detector": vars(s.detector) if spec.detector else None,
            "buffer": plan.buffer,
            **({"evictor_params": evictor_params} if evictor_params else {}),  # absent: the evictor's defaults
            **({"revisions": revisions} if revisions else {}),  # absent: each Hub model's main branch
            **_prm(plan.scorer),
            "max_step_tokens": s.max_step_tokens, "max_steps": s.max_steps, "context_cap": s.context_cap,
            "synthetic_steps": list(s.synthetic_steps) if s.synthetic_steps else None,
            "dtype": options.dtype, "problem_field": options.problem_field, "answer_field": options.answer_field,
            "random_stream": STREAM_VERSION,
            **({"grader": plan.grading.grader} if plan.grading.grader != "qwen" else {}),  # absent: the Qwen grader
            **({"prompt": plan.prompt} if plan.prompt != "math" else {}),  # absent: the paper's prompt
            **({"deterministic": True} if options.deterministic else {}),  # absent: batch-dependent kernels
            **_engine(plan),
        },
    )


def _prm(scorer: ScorerPlan) -> dict:
    """The PRM's input format (the qwen-math recipe's; None without a PRM) and its recipe (absent: Qwen2.5-Math-PRM's,
    in `prm_format`)."""
    qwen_math = scorer.kind == PRM and scorer.prm_recipe == "qwen-math"
    return {"prm_format": scorer.prm_format if qwen_math else None,
            **({"prm_recipe": scorer.prm_recipe} if scorer.kind == PRM and not qwen_math else {})}


def _engine(plan: CellPlan) -> dict:
    """With `--engine vllm`, the cell's roles on vLLM and vLLM's version (its random streams are its own)."""
    roles = plan.vllm_roles()
    if not roles:
        return {}
    from kvrescue.vllm_engine import require_vllm

    return {"engine": {"name": "vllm", "version": require_vllm().__version__, "roles": sorted(roles)}}


def _checksums(cell: Cell) -> dict[int, str]:
    """{idx: problem_checksum} of the cell's problems, as its run folder records them."""
    return {p.idx: problem_checksum(p.problem, p.gt) for p in cell.problems.problems}


def has_work(options: RunIO, cells: list[Cell], configs: list[RunConfig]) -> bool:
    """Whether some cell has a problem left to decode, each cell's run folder (its `configs` entry) read as
    `run_cell` opens it but nothing written (`RunFolder.done_in`): every cell is read, so a folder `run_cell` would
    refuse (another configuration, a changed problem) is its one-line error here, before any model is loaded."""
    work = False
    for cell, config in zip(cells, configs):  # all of them, not up to the first with work
        checksums = _checksums(cell)
        done = RunFolder.done_in(run_dir(options.out, config), config, root=options.out, overwrite=options.overwrite,
                                 problems=checksums)
        work = work or bool(checksums.keys() - done)
    return work


def run_cell(options: GridOptions, cell: Cell, executor: in_process.InProcessGroup | workers.RayWorkers | None,
             progress: Progress, config: RunConfig | None = None) -> Summary:
    """Decode the cell's missing problems into its run folder on `executor` (this process, or Ray actors; None
    where `has_work` found none) and return its summary. `config`: the cell's `cell_config`, when known."""
    config = cell_config(options, cell) if config is None else config
    problems = cell.problems.problems
    for note in same_cell_elsewhere(run_dir(options.out, config), config):
        progress.console.print(f"note: {note}", markup=False, highlight=False, soft_wrap=True)
    with RunFolder.open(run_dir(options.out, config), config, root=options.out, total=len(problems),
                        devices=list(options.devices),
                        executor=executor.describe() if executor is not None else None,
                        overwrite=options.overwrite, shard=options.shard, problems=_checksums(cell)) as folder:
        pending = [p for p in problems if p.idx not in folder.done]
        if pending and executor is None:
            raise RunFolderError(f"{folder.path}: its traces changed since this run read them (another kvrescue "
                                 "run?); run the same command again")
        rate = CellRate(len(problems), len(problems) - len(pending))
        task = progress.add_task(cell_label(config), total=len(problems), completed=rate.done, accuracy="",
                                 **rate.fields())

        def record(trace: Trace, tokens: int) -> None:
            folder.append(trace)
            rate.finished(trace.n_steps, tokens)
            accuracy = run_accuracy(config, folder.traces)
            progress.update(task, advance=1, accuracy=f"acc {'n/a' if accuracy is None else f'{100 * accuracy:.1f}%'}",
                            **rate.fields())

        def in_flight(totals: DecodeProgress) -> None:
            rate.in_flight(totals.committed_steps, totals.generated_tokens)
            progress.update(task, **rate.fields())

        try:
            if executor is not None:
                executor.decode_cell(cell, pending, record, in_flight)
        except BaseException as err:
            with suppress(RunFolderError):  # a full disk: the error that stopped the run is the one to show
                folder.write_summary()
            if isinstance(err, Exception) and not isinstance(err, (InputError, workers.WorkersGone)):
                raise CellFailed(_failure(config, folder, [p.idx for p in pending], err)) from err
            raise
        summary = folder.write_summary()
    decoded = f"{len(pending)} problem{'s' * (len(pending) != 1)} decoded"
    progress.console.print(f"{folder.path}: {decoded if pending else 'complete, summarised'}", markup=False,
                           highlight=False, soft_wrap=True)
    return summary


class CellFailed(RuntimeError):
    """An unexpected error inside a cell's decoding; the message (one line) names the cell, its unfinished problems
    and the error, and says that the finished ones are kept."""


def _failure(config: RunConfig, folder: RunFolder, pending: list[int], err: Exception) -> str:
    unfinished = [idx for idx in pending if idx not in folder.done]
    named = ", ".join(map(str, unfinished[:5])) + (f" and {len(unfinished) - 5} more" if len(unfinished) > 5 else "")
    reason = " ".join(str(err).split())[:300] or "no message"
    return (f"{cell_label(config)}: {type(err).__name__}: {reason}, with problem(s) {named} unfinished; the "
            f"{len(folder.done)} finished are kept in {folder.path}: run the same command again to resume")


def cell_label(config: RunConfig) -> str:
    """A cell as the progress and `kvrescue run`'s table name it: bench, method, B, N and seed."""
    budget = "" if config.budget is None else f" B={config.budget}"
    return f"{config.bench_name()} {config.method}{budget} N={config.n} seed={config.seed}"


def prepare_grid(options: GridOptions) -> tuple[GridOptions, list[Cell]]:
    """The options checked and resolved (`--prompt auto`, `--prm-recipe auto`) and the grid's cells, their problems
    read (this shard's, with --shard); one-line errors before any weights are read."""
    options.check()
    group = options.group_plan()
    options = replace(options, prompt=resolve_prompt(group), prm_recipe=resolve_prm_recipe(group))
    folder = data_dir(options.data_dir)
    sets = [load_problems(b, folder=folder, problem_field=options.problem_field, answer_field=options.answer_field,
                          limit=options.limit) for b in options.benches]
    if options.shard is not None:
        i, k = options.shard
        sets = [replace(problems, problems=problems.problems[i::k]) for problems in sets]
    cells = options.cells(sets)
    plan_for_device(options.group_plan(), options.devices[0])  # a base --tp does not split: an error before loading
    return options, cells


def run_grid(options: GridOptions, progress: Progress) -> list[tuple[RunConfig, Summary]]:
    """Every cell of the grid, models loaded once; cells already complete are only summarised, and a grid of
    complete cells loads no model and starts no vLLM engine or Ray actor."""
    options, cells = prepare_grid(options)
    configs = [cell_config(options, cell) for cell in cells]  # each reads its models' revisions: once

    def run_all(executor: in_process.InProcessGroup | workers.RayWorkers | None) -> list[tuple[RunConfig, Summary]]:
        return [(config, run_cell(options, cell, executor, progress, config)) for cell, config in zip(cells, configs)]

    def say(message: str) -> None:
        progress.console.print(message, markup=False, highlight=False, soft_wrap=True)

    work = has_work(options, cells, configs)  # a folder it refuses is the one line said
    say(f"{len(cells)} cell{'s' * (len(cells) != 1)}, each in its run folder under {options.out}:")
    for config in configs:
        say(f"  {cell_label(config)}: {run_dir(options.out, config).relative_to(options.out)}")
    if not work:
        return run_all(None)
    groups = options.groups()
    if len(groups) == 1 and options.ray_address is None:
        roles = ", ".join(f"{role} {model}" for role, model in options.group_plan().native_models().items())
        say(f"loading {roles} on {','.join(groups[0])}")
        started = time.monotonic()
        executor = in_process.InProcessGroup(options, groups[0])
        say(f"models loaded in {time.monotonic() - started:.1f} s")
        try:
            return run_all(executor)
        finally:
            executor.close()

    with workers.RayWorkers(options, say) as actors:
        actors.start()
        return run_all(actors)
