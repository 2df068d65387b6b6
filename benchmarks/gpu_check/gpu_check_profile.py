"""gpu_check's `profile` section, and the clock the problems section reads each model's share of the time with.

`PhaseClock` times one cell by phase from the benchmark side, without touching the engine: it wraps the methods of
the cell's runners and scorer (instance attributes over the class's, so the engine's own calls through `self` are
timed too) and the detector's gzip ratio, each call under a `torch.profiler.record_function` range of its phase:

- `base decode`, `helper decode`: a role's `start`, `advance` and its forward steps (`decode`), less what is nested;
- `sampling and detector`: a role's `prepare` (the iteration's sampling, step ends and detector launched: op by op
  through `Runner.sample`, or with CUDA graphs a replay of the iteration's graph, `engine/step_graphs.py`),
  `Runner.sample` wherever else it runs, and the detector's `gzip_ratio`, inside `advance`;
- `PRM feed and scoring`: the scorer's `open`, `launch` (or `score`), `commit`, `close` (the PRM's, or the
  helper-loglik's), and the read of launched scores (`scoring.PendingScores.wait`, an iteration later);
- `prefill`: a role's `prefill`; `commits and compression`: its `commit`, `fork_each`, `adopt`, `release` (the
  bounded cache compresses as its rows reach B');
- `controller`: the rest of the cell's wall time (the search's own work between those calls).

Each phase's time is exclusive (a nested call's time is its own phase's), so the phases add up to the cell's wall
time. With `sync` (the profile section on a GPU) every timed call ends with a device synchronisation, so the device
time of what a call launched is its phase's, and that wait is counted as the phase's `host waits` too (it perturbs
the overlap of host and device that the engine relies on: the profile says where the time goes, the problems section
how fast it goes). The section then runs the cell once more under `torch.profiler` to count, per decode iteration (a
base `advance`), the kernels launched on a GPU (eagerly and through CUDA graph launches, the decode steps' graphs and
the sampling's alike: the graphs' coverage), and on
a CPU the aten operations dispatched (the proxy that every change can be measured by without a GPU).
"""

from __future__ import annotations

import time
from collections import Counter
from contextlib import contextmanager, nullcontext
from dataclasses import replace
from typing import Any, Callable, Iterator

from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile, record_function

import kvrescue.engine.steps as steps_module
from kvrescue.engine.scoring import PendingScores
from benchmarks.gpu_check.gpu_check_record import Check
from benchmarks.gpu_check.gpu_check_setup import sync
from kvrescue.cell_plan import Cell
from kvrescue.cell_runners import CellRunners, build_cell
from kvrescue.data import ProblemSet
from kvrescue.decoding import decode_cell
from kvrescue.engine.loader import LoadedModel
from kvrescue.grid import GridOptions

RUNNER_PHASES = {"start": "{role} decode", "advance": "{role} decode", "decode": "{role} decode",
                 "prepare": "sampling and detector", "sample": "sampling and detector", "prefill": "prefill",
                 "commit": "commits and compression", "fork_each": "commits and compression",
                 "adopt": "commits and compression", "release": "commits and compression"}
SCORER_METHODS = ("open", "launch", "score", "commit", "close")
PHASES = ("base decode", "helper decode", "sampling and detector", "PRM feed and scoring", "prefill",
          "commits and compression", "controller")


class PhaseClock:
    """Exclusive seconds by phase of what runs inside `instrument(engine)` (and host waits with `sync`)."""

    def __init__(self, device: str, sync_calls: bool) -> None:
        self.device, self.sync_calls = device, sync_calls
        self.seconds: Counter = Counter()
        self.waits: Counter = Counter()
        self.calls: Counter = Counter()
        self._nested: list[float] = []  # per open call: seconds of the calls nested in it

    def timed(self, phase: str, fn: Callable, name: str) -> Callable:
        """`fn` timed as `phase`, its calls counted as `name`."""
        def call(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            self._nested.append(0.0)
            try:
                with record_function(phase):
                    result = fn(*args, **kwargs)
                    if self.sync_calls:
                        launched = time.perf_counter()
                        sync(self.device)
                        self.waits[phase] += time.perf_counter() - launched
                return result
            finally:
                spent = time.perf_counter() - start
                nested = self._nested.pop()
                self.seconds[phase] += spent - nested
                self.calls[name] += 1
                if self._nested:
                    self._nested[-1] += spent
        return call

    @contextmanager
    def instrument(self, engine: CellRunners) -> Iterator[None]:
        """Time the engine's runners, scorer and the detector while the body runs (the scorer under a `--tp` group's
        `RankZeroScores` is timed at that wrapper)."""
        for role, runner in engine.runners.items():
            for method, phase in RUNNER_PHASES.items():
                if hasattr(runner, method):
                    setattr(runner, method, self.timed(phase.format(role=role), getattr(runner, method),
                                                       f"{role}.{method}"))
        for method in SCORER_METHODS:
            if hasattr(engine.scorer, method):
                setattr(engine.scorer, method, self.timed("PRM feed and scoring", getattr(engine.scorer, method),
                                                          f"scorer.{method}"))
        gzip_ratio, wait = steps_module.gzip_ratio, PendingScores.wait
        steps_module.gzip_ratio = self.timed("sampling and detector", gzip_ratio, "detector.gzip_ratio")
        PendingScores.wait = self.timed("PRM feed and scoring", wait, "scorer.wait")
        try:
            yield
        finally:
            steps_module.gzip_ratio, PendingScores.wait = gzip_ratio, wait

    def shares(self, wall_s: float) -> dict:
        """Seconds and share of the wall time by phase (`controller`: the rest), and the host waits."""
        seconds = {p: self.seconds.get(p, 0.0) for p in PHASES if p != "controller"}
        seconds["controller"] = max(wall_s - sum(seconds.values()), 0.0)
        return {"wall_s": wall_s, "seconds": seconds, "share": {p: s / wall_s for p, s in seconds.items()},
                "host_waits_s": sum(self.waits.values()), "calls": dict(self.calls)}


def run_cell(options: GridOptions, cell: Cell, models: dict[str, LoadedModel], problems: ProblemSet,
             clock: PhaseClock | None = None) -> tuple[list, float]:
    """Decode one cell (timed by `clock` when given): its traces and wall seconds."""
    plan = options.plan_of(cell)
    engine = build_cell(plan, models)
    finished: list = []
    start = time.perf_counter()
    with clock.instrument(engine) if clock is not None else nullcontext():
        decode_cell(plan, cell, engine, iter(problems.problems),
                    lambda trace, _: finished.append(trace))
    sync(options.devices[0])
    return finished, time.perf_counter() - start


def launches(options: GridOptions, cell: Cell, models: dict[str, LoadedModel], problems: ProblemSet,
             device: str) -> dict:
    """Per decode iteration of the cell, under torch.profiler: kernels on a GPU (eager launches and CUDA graph
    launches, and the share of kernels that graphs ran), aten operations dispatched on a CPU."""
    clock = PhaseClock(device, sync_calls=False)
    gpu = device.startswith("cuda")
    with profile(activities=[ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if gpu else [])]) as prof:
        run_cell(options, cell, models, problems, clock)
    iterations = max(clock.calls["base.advance"], 1)
    counts = Counter()
    for event in prof.key_averages():
        if event.device_type == DeviceType.CUDA and not event.key.startswith(("Memcpy", "Memset")):
            counts["kernels"] += event.count
        elif event.key.startswith(("cudaLaunchKernel", "cuLaunchKernel")):
            counts["eager_launches"] += event.count
        elif event.key.startswith("cudaGraphLaunch"):
            counts["graph_launches"] += event.count
        elif event.key.startswith("aten::"):
            counts["aten_ops"] += event.count
    per = {f"{k}_per_iteration": v / iterations for k, v in counts.items()}
    coverage = ((counts["kernels"] - counts["eager_launches"]) / counts["kernels"]
                if gpu and counts["kernels"] else None)
    return {"decode_iterations": iterations, **per, "graph_kernel_share": coverage}


def profile_cell(options: GridOptions, models: dict[str, LoadedModel], problems: ProblemSet, plan: dict,
                 device: str) -> dict:
    """One kvrescue cell's time by phase (a synchronisation after every timed call), then its launches."""
    cell = Cell(problems, "kvrescue", plan["budget"], plan["n"], 0)
    clock = PhaseClock(device, sync_calls=device.startswith("cuda"))
    finished, wall = run_cell(options, cell, models, problems, clock)
    try:  # the phases stand whatever becomes of the profiler's run (CUDA graphs captured under CUPTI, say)
        counted = launches(options, cell, models, replace(problems, problems=problems.problems[:2]), device)
    except Exception as err:  # noqa: BLE001 - recorded, as Check.measure records a failed measurement
        counted = {"failed": f"{type(err).__name__}: {err}"[:300]}
    return {"problems": len(finished), **clock.shares(wall), "launches": counted}


def profile_section(check: Check, options: GridOptions, models: Callable[[], dict[str, LoadedModel]],
                    problems: ProblemSet, plan: dict, device: str, end: float) -> None:
    """The profile of one kvrescue cell of `problems` (`options`' steps and CUDA graphs), within `end`."""
    record = {"method": "kvrescue", "cuda_graphs": options.cuda_graphs, "problems_in": len(problems.problems),
              "synthetic_steps": list(options.settings.synthetic_steps)}
    check.measure("profile", record, end, lambda: profile_cell(options, models(), problems, plan, device), until=end)
