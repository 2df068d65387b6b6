"""The executor over Ray: one actor per device group (`group_worker.GroupWorker`), each holding the grid's models, fed
problem by problem by this driver (`RayWorkers`; its queue `work_queue.WorkQueue`, the actors' placement
`ray_placement`).

Two or more device groups (or `--ray-address`) run as Ray actors, on a private local Ray instance started
here and shut down at the end, or on the cluster at `--ray-address`; one device decodes in the `kvrescue
run` process itself (`in_process.InProcessGroup`). A group is one device today; with tensor parallelism it is K.

An actor asks the driver for a problem whenever its controller has a free slot (work stealing: a fast
actor simply asks more often) and streams each finished problem's trace back; the driver alone writes
the run folder. Because the driver hands out every problem, it always knows what each actor holds:
when an actor dies (killed, out of memory, CUDA error, lost node) its problems go back to the queue and
a fresh actor is started for its group, at most GROUP_RESTARTS times. A problem that was in flight when
an actor died is afterwards decoded alone on an actor, so a second death is its own: it is then recorded
as failed with both errors. Ray's own actor restarts (`max_restarts`) stay off: the driver must see every
death to requeue and count, and a fresh actor is what a restart would give anyway.

Messages travel as the results and arguments of `GroupWorker.exchange`, one call always in flight per
actor (so a death is seen whatever the actor is doing); `GroupWorker.begin(cell)` starts decoding a cell.
Actor -> driver: ("ready", placement) models loaded; ("want",) a free slot; ("trace", Trace, tokens);
("progress", steps, tokens) the running totals of its decode of the cell, every few seconds (the driver's
progress bar sums them over the actors); ("idle",) the cell's problems are done here; ("error", message) a configuration error (stops the run);
("crash", message) an exception (the driver then kills the actor). Driver -> actor: ("problem", Problem)
or ("none",) the answer to "want".
"""

from __future__ import annotations

import os
from collections import Counter, deque
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Callable

from grader import normal_gt
from kvrescue.data import Problem
from kvrescue.device_plan import batch_description
from kvrescue.devices import RAY_QUIET, device_shares
from kvrescue.errors import InputError
from kvrescue.group_worker import GroupWorker
from kvrescue.outputs import Trace
from kvrescue.ray_placement import actor_resources, cpu_threads, named_gpus
from kvrescue.search import DecodeProgress
from kvrescue.work_queue import WorkQueue

if TYPE_CHECKING:
    from kvrescue.cell_plan import Cell
    from kvrescue.grid import GridOptions

GROUP_RESTARTS = 3   # deaths after which a device group gets no new actor
CLOSE_WAIT_S = 60.0  # how long the driver, at the end, waits for idle actors to close their --tp groups
OBJECT_STORE = 128 * 2**20  # a private instance's object store: problems and traces are small and travel inline


class WorkersGone(RuntimeError):
    """Every worker died; the run folder holds what finished and the run resumes when re-run."""


@dataclass
class _Worker:
    number: int
    group: int
    devices: tuple[str, ...]
    actor: Any                # a Ray actor handle of GroupWorker
    call: Any = None          # the exchange in flight (an ObjectRef)
    state: str = "loading"    # loading | idle | running
    placement: dict | None = None
    last: int | None = None
    error: str | None = None

    @property
    def name(self) -> str:
        where = self.placement
        place = "not placed yet" if where is None else (
            f"on node {where['node']} ({where['node_id'][:8]}), "
            + (f"GPU {','.join(where['gpus'])}, " if where["gpus"] else "")
            + f"pid {where['pid']}")
        return f"worker {self.number} ({','.join(self.devices)} {place})"


def _death(err: Exception) -> str:
    """Ray's account of an actor's death, without its list of common causes."""
    text = " ".join(str(err).split())
    start = text.find("The actor is dead because")
    return (text[start:] if start >= 0 else text).split(" Some common causes")[0][:500]


class RayWorkers:
    """One Ray actor per device group; `start` them before the first cell, use as a context manager."""

    def __init__(self, options: GridOptions, say: Callable[[str], None]) -> None:
        self.options = options
        self.say = say
        self.groups = options.groups()
        self.resources = [actor_resources(self.groups, group) for group in range(len(self.groups))]
        self.workers: list[_Worker] = []
        self.deaths: Counter = Counter()
        self.last_errors: dict[int, str] = {}
        self.started = 0  # workers started so far (numbers them)
        self.private = False  # this run started the Ray instance, and shuts it down
        self.in_flight: dict[int, DecodeProgress] = {}  # each actor's running totals of the cell being decoded
        self.on_progress: Callable[[DecodeProgress], None] | None = None

    def __enter__(self) -> RayWorkers:
        return self

    def __exit__(self, *exc) -> None:
        import ray

        closing = [w.actor.close.remote() for w in self.workers if w.state == "idle"]  # a busy one is killed as is
        if closing:
            ray.wait(closing, num_returns=len(closing), timeout=CLOSE_WAIT_S)
        for worker in self.workers:
            ray.kill(worker.actor, no_restart=True)
        self.workers = []
        if self.private:
            ray.shutdown()

    def _init(self) -> None:
        import ray

        if ray.is_initialized():
            return
        gpus = named_gpus(self.groups, os.environ.get("CUDA_VISIBLE_DEVICES"))
        if gpus:  # Ray hands its actors exactly the GPUs it sees: those named
            os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(gpus)
        # Ray starts its workers at niceness 15: beside other work on the machine an actor then gets a few percent of
        # a core (docs/benchmarks.md, "Ray actors' niceness"); its raylet passes this to them, unless the user set it.
        os.environ.setdefault("RAY_worker_niceness", "0")
        # "local": a new instance even where this node belongs to a cluster (joining one takes --ray-address)
        ray.init(address="local", num_cpus=len(self.groups), num_gpus=len(gpus), object_store_memory=OBJECT_STORE,
                 **RAY_QUIET)
        self.private = True

    def _start(self, group: int) -> None:
        import ray

        devices = self.groups[group]
        actor = ray.remote(GroupWorker).options(
            **self.resources[group], max_restarts=0,
            max_concurrency=2,  # `begin` runs while `exchange` waits
        ).remote(self.options, devices, cpu_threads(self.groups), device_shares(self.groups, group), self.deaths[group] > 0)
        worker = _Worker(self.started, group, devices, actor)
        worker.call = actor.exchange.remote([])
        self.workers.append(worker)
        self.started += 1

    def start(self) -> None:
        """Start one actor per group and wait until each holds the models: a configuration error (a
        missing model, say) raises here, before any run folder is opened."""
        self._init()
        for group in range(len(self.groups)):
            self._start(group)
        idle = WorkQueue(deque())
        while any(w.state == "loading" for w in self.workers):
            self._wait(idle, None, lambda trace, tokens: None)
        if not self.workers:
            raise WorkersGone(f"no worker could start ({self._errors()})")

    def describe(self) -> dict[str, Any]:
        """The executor, for config.json: Ray's version, the cluster's nodes, where each worker runs."""
        import ray

        return {"kind": "ray", "ray": ray.__version__, "address": self.options.ray_address or "local",
                **batch_description(self.options.group_plan()),
                "nodes": sum(node["Alive"] for node in ray.nodes()),
                "workers": [{"devices": list(w.devices), **(w.placement or {})} for w in self.workers]}

    def decode_cell(self, cell: Cell, problems: list[Problem], emit: Callable[[Trace, int], None],
                    on_progress: Callable[[DecodeProgress], None] | None = None) -> None:
        """Decode `problems` of `cell` on the actors, emitting every problem's trace exactly once, and the
        actors' running totals, summed, to `on_progress` as they report them (every few seconds each)."""
        self.in_flight, self.on_progress = {}, on_progress
        queue = WorkQueue(deque(problems))
        slim = replace(cell, problems=replace(cell.problems, problems=[]))
        while True:
            for worker in self.workers:
                if worker.state == "idle" and queue.pending:
                    worker.actor.begin.remote(slim)
                    worker.state = "running"
            if queue.empty and all(w.state != "running" for w in self.workers):
                return
            if not self.workers:
                raise WorkersGone(f"every worker is gone ({self._errors()}); {len(queue.pending)} problems of this "
                                  "cell are not done; what finished is written: run the same command again to resume")
            self._wait(queue, cell, emit)

    def _errors(self) -> str:
        return "; ".join(f"group {group}: {error}" for group, error in self.last_errors.items())

    def _wait(self, queue: WorkQueue, cell: Cell | None, emit: Callable[[Trace, int], None]) -> None:
        """Wait for one actor's messages (or its death), answer them, and bury it if it died."""
        import ray

        calls = {w.call: w for w in self.workers}
        (done,), _ = ray.wait(list(calls), num_returns=1)
        worker = calls[done]
        try:
            messages = ray.get(done)
        except ray.exceptions.RayError as err:
            self._bury(worker, queue, cell, emit, worker.error or _death(err))
            return
        replies = []
        for kind, *body in messages:
            if kind == "want":
                problem = queue.take(worker.number)
                replies.append(("none",) if problem is None else ("problem", problem))
                worker.last = worker.last if problem is None else problem.idx
            elif kind == "trace":
                trace, tokens = body
                queue.done(worker.number, trace.idx)
                emit(trace, tokens)
            elif kind == "progress":
                self.in_flight[worker.number] = DecodeProgress(*body)
                if self.on_progress is not None:
                    self.on_progress(DecodeProgress(sum(p.committed_steps for p in self.in_flight.values()),
                                                    sum(p.generated_tokens for p in self.in_flight.values())))
            elif kind == "ready":
                worker.state, worker.placement = "idle", body[0]
            elif kind == "idle":
                worker.state = "idle"
            elif kind == "crash":
                worker.error = body[0]
            elif kind == "error":
                raise InputError(body[0])
        if worker.error is not None:
            self._bury(worker, queue, cell, emit, worker.error)
        else:
            worker.call = worker.actor.exchange.remote(replies)

    def _bury(self, worker: _Worker, queue: WorkQueue, cell: Cell | None, emit: Callable[[Trace, int], None],
              error: str) -> None:
        """Record a dead actor: requeue its problems, fail those struck out, start a new one for its group."""
        import ray

        ray.kill(worker.actor, no_restart=True)  # crashed, or unreachable (a node lost): it must not come back
        holding = sorted(queue.held.get(worker.number, {}))
        failed = queue.lost(worker.number, error)
        self.workers.remove(worker)
        self.deaths[worker.group] += 1
        self.last_errors[worker.group] = error
        restart = self.deaths[worker.group] < GROUP_RESTARTS
        self.say(f"{worker.name} died ({error}) holding problems {holding or 'none'}; last problem given: "
                 f"{worker.last}; " + ("starting a new worker for its group" if restart
                                       else f"its group died {self.deaths[worker.group]} times: no new worker"))
        for problem in failed:  # a queue holding problems comes with their cell
            errors = queue.errors[problem.idx]
            gt_norm = normal_gt(problem.gt, cell.problems.grading_bench, self.options.grader)
            emit(Trace.failed(problem.idx, problem.problem, problem.gt, gt_norm,
                              f"killed {len(errors)} workers: " + "; ".join(errors)), 0)
            self.say(f"problem {problem.idx} killed {len(errors)} workers: recorded as failed")
        if restart:
            self._start(worker.group)
