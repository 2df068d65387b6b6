"""One device group's work: load the grid's models on it, and decode a cell's problems with them.

The same code runs in the `kvrescue run` process (one device) and in every worker (two or more groups).
"""

from __future__ import annotations

import importlib.util
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import replace
from typing import Any, Callable, Iterable, Iterator

import psutil
import torch

from grader import grade, normal_gt
from kvrescue_cli import memory_plan as planner
from kvrescue_cli.cost import Architecture
from kvrescue_cli.data import Problem
from kvrescue_cli.devices import is_cpu, is_gpu
from kvrescue_cli.dtypes import dtype_bytes
from kvrescue_cli.engine.bounded import BoundedCache
from kvrescue_cli.engine.caches import FullCache
from kvrescue_cli.engine.loader import LoadedModel, ModelLoadError, load_model
from kvrescue_cli.engine.prm import PRMScorer, check_prm
from kvrescue_cli.engine.runner import Runner
from kvrescue_cli.engine.scoring import HelperLoglik, Scorer
from kvrescue_cli.errors import InputError
from kvrescue_cli.grading import answer_part
from kvrescue_cli.grid import Cell, GridOptions
from kvrescue_cli.outputs import Trace
from kvrescue_cli.outputs.decoded import trace_of
from kvrescue_cli.prompts import generation_prompt
from kvrescue_cli.rank_group import RankGroup, RankZeroScores
from kvrescue_cli.methods import METHODS
from kvrescue_cli.model_config import ModelConfigError, window_error
from kvrescue_cli.search import Controller, DecodeProgress, Finished, SearchSettings, StepRunner
from kvrescue_cli.vllm_engine.roles import EngineSpec, VllmEngines, engine_specs

CPU_PARAMS = 3e9  # larger models are refused on a CPU: hours per problem, and tens of GB in fp32


def refuse_large_on_cpu(role: str, name: str) -> None:
    """A one-line error, before any weights are read, for a model too large to decode on a CPU."""
    try:
        params = Architecture.of_model(name).params
    except ModelConfigError:  # no usable config: the loader says why
        return
    if params > CPU_PARAMS:
        raise InputError(f"{role} model {name} has {params / 1e9:.1f}B parameters, too many for a CPU run; "
                         "use --device cuda, --preset cpu-demo, or smaller local models with --base/--helper/--prm")


def device_kind(options: GridOptions, device: str) -> planner.DeviceKind:
    """How the engine computes on `device` for the planner: its kernels follow the device, dtype and flash-attn."""
    cuda, size = is_gpu(device), dtype_bytes(options.dtype)
    flash = cuda and size == 2 and importlib.util.find_spec("flash_attn") is not None
    return planner.DeviceKind(cuda, size, flash, options.cuda_graphs, options.tp)


def memory_plan(options: GridOptions, device: str = "cuda:0", batch: int | None = None) -> planner.DevicePlan | None:
    """One device's plan for the grid's largest cell (`batch`: in place of --batch); None when a model has no
    readable config (the loader then says why)."""
    return planner.readable_plan(options, device_kind(options, device), batch)


def device_memory(device: str, given: int | None = None) -> tuple[int, int]:
    """(free, total) bytes of a GPU, or of RAM (available, total) for the CPU; `given` (--device-memory) stands for
    both."""
    if given is not None:
        return given, given
    if is_gpu(device):
        return torch.cuda.mem_get_info(torch.device(device))
    ram = psutil.virtual_memory()
    return ram.available, ram.total


def device_room(options: GridOptions, device: str, shares: int = 1, context: bool = True) -> int:
    """Bytes of `device` this worker may plan for: what is free of it (`context=False`: its total, read without
    creating a CUDA context, for a driver whose workers run elsewhere), at most its 1/`shares` (a device named by
    `shares` workers, `--devices cuda:0,cuda:0`), less vLLM's share of it with `--engine vllm`."""
    if not context and options.device_memory is None and is_gpu(device):
        free = total = torch.cuda.get_device_properties(torch.device(device)).total_memory
    else:
        free, total = device_memory(device, options.device_memory)
    vllm = int(options.vllm_memory * total) if options.engine == "vllm" else 0
    return min(free - vllm, total // shares)


def group_room(options: GridOptions, group: tuple[str, ...], shares: int = 1, context: bool = True) -> tuple[str, int]:
    """The group's device with the least room for this worker (`device_room`), and its bytes."""
    room, device = min((device_room(options, device, shares, context), device) for device in group)
    return device, room


def checks_memory(options: GridOptions, device: str) -> bool:
    """Whether a worker on `device` is refused a plan that does not fit: on CUDA, or wherever --device-memory says."""
    return is_gpu(device) or options.device_memory is not None


def refuse_what_does_not_fit(options: GridOptions, free_bytes: int, beside_vllm: bool = False,
                             device: str = "cuda:0") -> None:
    """A one-line error, before any weights are read, when the grid's largest cell needs more than `free_bytes` on
    `device` (with `beside_vllm`: what is left beside vLLM's share)."""
    hints = [h for h, on in (("--dtype bfloat16", dtype_bytes(options.dtype) > 2),
                             ("--vllm-memory", beside_vllm)) if on]
    planner.refuse_what_does_not_fit(memory_plan(options, device), free_bytes, device, beside_vllm, hints)


def wait_for_room(options: GridOptions, group: tuple[str, ...], shares: int = 1, wait_s: float = 0.0,
                  clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep) -> None:
    """Refuse, before any group forms, a plan that does not fit the group's devices; with `wait_s`, first wait up to
    that long for memory to be released (a restarted worker: its dead predecessor's memory may not be yet)."""
    if not checks_memory(options, group[0]):
        return
    plan, deadline = memory_plan(options, group[0]), clock() + wait_s
    device, room = group_room(options, group, shares)
    while plan is not None and plan.total > room - planner.headroom(room) and clock() < deadline:
        sleep(1.0)
        device, room = group_room(options, group, shares)
    refuse_what_does_not_fit(options, room, device=device)


def auto_batch(options: GridOptions, groups: list[tuple[str, ...]], shares: int = 1, context: bool = True) -> int:
    """`--batch auto`: the most problems in flight whose plan fits every group's devices with headroom; a one-line
    error when one problem does not fit. `context=False`: from the devices' total memory (`device_room`)."""
    device, free = min((group_room(options, group, shares, context) for group in groups), key=lambda found: found[1])
    kind, models = device_kind(options, device), planner.grid_models(options)
    batch = planner.largest_batch(lambda b: planner.plan_grid(options, kind, b, models), free - planner.headroom(free))
    if batch is None:
        planner.refuse_what_does_not_fit(planner.plan_grid(options, kind, 1, models), free, device)
    return batch


def vllm_specs(options: GridOptions) -> list[EngineSpec]:
    """The vLLM engines the grid starts (`vllm_engine.roles.engine_specs` of its vLLM roles)."""
    return engine_specs(options.vllm_models(), options.settings.context_cap)


def vllm_memory(options: GridOptions, device: str, free: int, total: int) -> list[dict]:
    """Each vLLM engine's share of the device as `start_llm` takes it (`roles.engine_specs` order), after one-line
    errors, before anything is loaded, for a plan that does not fit: vLLM gets --vllm-memory of the device (of RAM
    on a CPU), split evenly between its engines, each of which must hold its weights and one whole context's KV;
    on a GPU this engine's models and caches must fit in the rest. On a CPU an engine's KV cache is given in bytes
    (vLLM's share of RAM there counts its whole process). `free`, `total`: the device's bytes (`device_memory`)."""
    specs = vllm_specs(options)
    if not specs:
        return []
    share = options.vllm_memory * total
    each, size, shares = share / len(specs), dtype_bytes(options.dtype), []
    for spec in specs:
        try:
            arch = replace(Architecture.of_model(spec.model), dtype_bytes=size)
        except ModelConfigError as err:
            raise InputError(f"{'/'.join(spec.roles)} model {spec.model}: no usable config.json for vLLM ({err})") from None
        need = arch.params * size + arch.kv_bytes_per_token * spec.max_model_len
        if need > each:
            raise InputError(f"--vllm-memory {options.vllm_memory}: vLLM's {share / 2**30:.2f} GiB of {device} over its "
                             f"{len(specs)} engine(s) leaves {each / 2**30:.2f} GiB for the {'/'.join(spec.roles)} "
                             f"model, whose weights and one {spec.max_model_len}-token context need "
                             f"{need / 2**30:.2f} GiB; raise --vllm-memory")
        shares.append({"memory": each / total} if is_gpu(device)
                      else {"kv_cache_bytes": int(each - arch.params * size)})
    if is_gpu(device):
        refuse_what_does_not_fit(options, int(free - share), beside_vllm=True, device=device)
    elif share > free:
        raise InputError(f"--vllm-memory {options.vllm_memory}: {share / 2**30:.1f} GiB of RAM for vLLM, but "
                         f"{free / 2**30:.1f} GiB is available; lower --vllm-memory")
    return shares


def batch_description(options: GridOptions) -> dict:
    """The batch --batch auto chose, for config.json's executor (nothing for a batch given as a number)."""
    return {"batch": options.settings.batch, "batch_auto": True} if options.batch_auto else {}


def check_policy_tokenizers(tokenizers: dict[str, Any]) -> None:
    """Base and helper (by role) must share a tokenizer: KV-Rescue commits the same tokens to both."""
    policy = [tokenizers[r] for r in ("base", "helper") if r in tokenizers]
    if len(policy) == 2 and policy[0].get_vocab() != policy[1].get_vocab():
        raise InputError("base and helper tokenizers differ; KV-Rescue commits the same tokens to both models")


def use_device(device: str) -> None:
    """Make a GPU this process's current device: streams, graphs, NCCL and every default-device call use it, not
    cuda:0."""
    if is_gpu(device):
        torch.cuda.set_device(device)


def load_roles(options: GridOptions, device: str) -> dict[str, LoadedModel]:
    """Every model the grid runs on this engine, loaded once on `device`; base and helper must share a tokenizer."""
    loaded: dict[str, LoadedModel] = {}
    by_name: dict[str, LoadedModel] = {}
    use_device(device)
    for role in sorted(options.native_roles()):
        name = options.models[role]
        if is_cpu(device):
            refuse_large_on_cpu(role, name)
        try:
            if name not in by_name:
                by_name[name] = load_model(name, options.dtype, device, tp=options.tp, exact_heads=role == "base")
        except ModelLoadError as err:
            raise InputError(f"{role} model: {err}; on a CPU without the Hub try --preset cpu-demo, "
                             "or give local folders with --base/--helper/--prm") from None
        loaded[role] = by_name[name]
        reason = role != "prm" and window_error(loaded[role].config, options.settings.context_cap)
        if reason:
            raise InputError(f"{role} model {name}: {reason}")
    if "prm" in loaded:
        try:
            check_prm(loaded["prm"], options.prm_input_recipe())
        except ValueError as err:
            raise InputError(f"--prm: {err}") from None
    check_policy_tokenizers({role: model.tokenizer for role, model in loaded.items()})
    return loaded


def full_tokens(s: SearchSettings, n: int) -> int:
    """Token room of a full-context cache (base `full`, helper) for a cell of N candidates."""
    return planner.full_cache_tokens(s.batch, n, s.max_step_tokens, s.context_cap)


def loglik_tokens(s: SearchSettings, n: int) -> int:
    """Token room of the helper-loglik scorer's cache."""
    return planner.loglik_cache_tokens(s.batch, n, s.max_step_tokens, s.context_cap)


def _runners(options: GridOptions, cell: Cell, models: dict[str, LoadedModel],
             vllm: VllmEngines | None = None) -> dict[str, StepRunner]:
    """Fresh caches for one cell: the base evicted or full, the helper full; a role on vLLM, a fresh `VllmRunner`."""
    spec, s = METHODS[cell.method], options.settings
    runners: dict[str, StepRunner] = {}
    for role in sorted(options.vllm_roles([cell.method]) - {"prm"}):
        runners[role] = vllm.runner(role)
    if spec.base and "base" not in runners:
        base = models["base"]
        cache = (BoundedCache.for_model(base.net, cell.budget, options.evictor, buffer=options.buffer,
                                        max_append=s.max_step_tokens, rows=s.batch * (cell.n + 1))
                 if options.evicts(cell.method)
                 else FullCache.for_model(base.net, full_tokens(s, cell.n), max_rows=s.batch * (2 * cell.n + 2)))
        runners["base"] = Runner(base, cache, cuda_graphs=options.cuda_graphs)
    if spec.helper and "helper" not in runners:
        helper = models["helper"]
        cache = FullCache.for_model(helper.net, full_tokens(s, cell.n), max_rows=s.batch * (2 * cell.n + 2))
        runners["helper"] = Runner(helper, cache)
    return runners


def _scorer(options: GridOptions, cell: Cell, models: dict[str, LoadedModel], vllm: VllmEngines | None = None) -> Scorer:
    s = options.settings
    if options.on_vllm("prm", cell.method) and options.scorer == "prm":
        return vllm.scorer()
    if options.scorer == "prm":
        return PRMScorer(models["prm"], max_problems=s.batch, max_candidates=s.batch * 2 * cell.n,
                         max_step_tokens=s.max_step_tokens, recipe=options.prm_input_recipe())
    helper = models["helper"]
    cache = FullCache.for_model(helper.net, loglik_tokens(s, cell.n), max_rows=s.batch * (2 * cell.n + 2))
    return HelperLoglik(Runner(helper, cache))


def decode(options: GridOptions, cell: Cell, models: dict[str, LoadedModel], problems: Iterable[Problem],
           emit: Callable[[Trace, int], None], on_progress: Callable[[DecodeProgress], None] | None = None,
           vllm: VllmEngines | None = None) -> None:
    """Decode `problems` of one cell, pulled lazily (so they may come from a shared queue), and `emit`
    each one's trace with the tokens it generated: skipped ones when pulled, decoded ones as they finish;
    `on_progress` gets running totals every few seconds while problems are in flight. `vllm`: the engines of
    the roles on vLLM (`--engine vllm`)."""
    role = "base" if METHODS[cell.method].base else "helper"
    tokenizer, eos_ids = vllm.tokenizers[role] if options.on_vllm(role, cell.method) else \
        (models[role].tokenizer, models[role].eos_ids)
    cap = options.settings.context_cap
    by_idx: dict[int, Problem] = {}

    def work() -> Iterator[tuple[int, str, list[int]]]:
        for problem in problems:
            prompt = tokenizer.encode(generation_prompt(tokenizer, problem.problem, options.prompt),
                                      add_special_tokens=False)
            if len(prompt) >= cap:
                gt_norm = normal_gt(problem.gt, cell.problems.grading_bench, options.grader)
                emit(Trace.skipped(problem.idx, problem.problem, problem.gt, gt_norm,
                                   f"prompt has {len(prompt)} tokens, context cap is {cap}"), 0)
            else:
                by_idx[problem.idx] = problem
                yield problem.idx, problem.problem, prompt

    grading = Grading(cell.problems.grading_bench, emit, options.grader, options.also_grade)

    def grade_finished(finished: Finished) -> None:
        grading.submit(finished, by_idx.pop(finished.state.idx))
        grading.emit_graded()

    def progress(totals: DecodeProgress) -> None:
        grading.emit_graded()
        if on_progress is not None:
            on_progress(totals)

    scorer = _scorer(options, cell, models, vllm)
    controller = Controller(options.settings, _runners(options, cell, models, vllm),
                            RankZeroScores(scorer) if options.tp > 1 else scorer, set(eos_ids),
                            method=cell.method, n=cell.n, seed=cell.seed)
    try:
        controller.run(work(), grade_finished, progress)
        grading.emit_graded(wait=True)
    finally:
        grading.close()


_GRADING_THREAD: list[ThreadPoolExecutor] = []


def _grading_thread() -> ThreadPoolExecutor:
    """The process's one grading thread, kept for its whole life: the grader's sympy workers, which it starts,
    are killed when the thread that started them ends (PR_SET_PDEATHSIG follows the parent thread)."""
    if not _GRADING_THREAD:
        _GRADING_THREAD.append(ThreadPoolExecutor(1, thread_name_prefix="kvrescue-grading"))
    return _GRADING_THREAD[0]


class Grading:
    """Grades decoded problems on the grading thread, so that the decode loop never waits for the grader
    (its sympy workers may take seconds); the traces are emitted on the decode thread, as they are graded,
    in the order the problems finished."""

    def __init__(self, bench: str, emit: Callable[[Trace, int], None], grader: str = "qwen",
                 also: tuple[str, ...] = ()) -> None:
        self.bench, self.emit, self.grader, self.also = bench, emit, grader, also
        self.pending: deque[Future] = deque()

    def submit(self, finished: Finished, problem: Problem) -> None:
        """Grade a decoded problem off this thread."""
        self.pending.append(_grading_thread().submit(self._trace, finished, problem))

    def _trace(self, finished: Finished, problem: Problem) -> tuple[Trace, int]:
        answer, where = answer_part(finished.output)
        verdict = grade(answer, problem.gt, self.bench, grader=self.grader)
        others = {name: grade(answer, problem.gt, self.bench, grader=name) for name in self.also}
        graders = {name: {"pred": v.pred, "correct": v.correct, "timed_out": v.timed_out} for name, v in others.items()}
        return (trace_of(finished, problem, verdict.gt, verdict.pred, verdict.correct, verdict.timed_out, graders,
                         where), sum(finished.state.generated.values()))

    def emit_graded(self, wait: bool = False) -> None:
        """Emit the traces graded so far (`wait`: all of them, once graded)."""
        while self.pending and (wait or self.pending[0].done()):
            self.emit(*self.pending.popleft().result())

    def close(self) -> None:
        """Emit what is graded and drop the rest (after an interruption: those problems are decoded again on
        resume)."""
        try:
            self.emit_graded()
        finally:
            for future in self.pending:
                future.cancel()
            self.pending.clear()


class InProcessGroup:
    """One device group decoding in this process, its models loaded once: the executor without Ray (with
    `--tp K`, this process is rank 0 of the group's K processes)."""

    def __init__(self, options: GridOptions, group: tuple[str, ...]) -> None:
        self.options = options
        self.group = group
        self.ranks: RankGroup | None = None
        self.vllm: VllmEngines | None = None
        device = group[0]  # a device of --devices, named as this process sees it
        use_device(device)
        # One-line errors before any group forms or weights are read (a refusal inside a group would hang its ranks).
        shares = vllm_memory(options, device, *device_memory(device, options.device_memory))
        if not shares:
            wait_for_room(options, group)
        try:
            self.ranks = RankGroup(options, group) if len(group) > 1 else None
            self.models = load_roles(options, device)
            if options.engine == "vllm":
                self.vllm = VllmEngines(vllm_specs(options), options.dtype, options.prm_input_recipe(), shares)
                check_policy_tokenizers({**{role: m.tokenizer for role, m in self.models.items()},
                                         **{role: t for role, (t, _) in self.vllm.tokenizers.items()}})
        except BaseException:
            self.close()
            raise

    def decode(self, cell: Cell, problems: list[Problem], emit: Callable[[Trace, int], None],
               on_progress: Callable[[DecodeProgress], None] | None = None) -> None:
        """Decode `problems` of `cell` here, emitting every problem's trace once (and running totals to
        `on_progress` every few seconds)."""
        if problems:
            decode(self.options, cell, self.models, self.ranks.lead(cell, problems) if self.ranks else problems, emit,
                   on_progress, self.vllm)

    def close(self) -> None:
        """Stop the group's other ranks and the vLLM engines, if any."""
        if self.ranks is not None:
            self.ranks.close()
        if self.vllm is not None:
            self.vllm.close()

    def describe(self) -> dict:
        """The executor, for config.json."""
        return {"kind": "in-process", "devices": list(self.group), **({"tp": self.options.tp} if self.ranks else {}),
                **batch_description(self.options),
                **({"vllm_memory": self.options.vllm_memory} if self.vllm else {})}
