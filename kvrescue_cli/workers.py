"""Worker processes: one per device, each holding the grid's models, fed problem by problem by the parent.

A worker asks the parent for a problem whenever its controller has a free slot (work stealing: a fast
worker simply asks more often) and streams each finished problem's trace back; the parent alone writes
the run folder. Because the parent hands out every problem, it always knows what each worker holds:
when a worker dies (killed, out of memory, CUDA error) its problems go back to the queue and a fresh
worker starts on its device. A problem that was in flight when a worker died is afterwards decoded
alone on a worker, so a second death is its own: it is then recorded as failed with both errors.

Workers are started with the `spawn` method (never `fork`, which is unsafe once CUDA is initialised)
and die with the parent (PR_SET_PDEATHSIG). They ignore SIGINT: on Ctrl-C the parent stops them.

Messages, worker -> parent: ("ready",) models loaded; ("want",) a free slot; ("trace", Trace, tokens);
("idle",) the cell's problems are done here; ("error", message) a configuration error (stops the run);
("crash", message) an exception, just before exiting. Parent -> worker: ("run", cell) decode problems
of `cell`, asking for them; ("problem", Problem) or ("none",) the answer to "want"; ("stop",).
"""

from __future__ import annotations

import os
import signal
from collections import Counter, deque
from dataclasses import dataclass, field, replace
from multiprocessing import get_context
from multiprocessing.connection import Connection, wait
from typing import TYPE_CHECKING, Callable, Iterator

from grader import grade
from grader.sandbox import die_with_parent
from kvrescue_cli.data import Problem
from kvrescue_cli.errors import InputError
from kvrescue_cli.outputs import Trace

if TYPE_CHECKING:
    from multiprocessing.process import BaseProcess

    from kvrescue_cli.grid import Cell, GridOptions

STRIKES = 2          # worker deaths a problem may be part of before it is recorded as failed
DEVICE_RESTARTS = 3  # deaths after which a device gets no new worker


class WorkersGone(RuntimeError):
    """Every worker died; the run folder holds what finished and the run resumes when re-run."""


def resolve_devices(spec: str) -> tuple[str, ...]:
    """`auto` (every visible GPU, else the CPU), `cpu`, `cuda` (= cuda:0), or a comma list (`cuda:0,cuda:1`, `cpu,cpu`)."""
    import torch

    if spec == "auto":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        return tuple(f"cuda:{i}" for i in range(count)) or ("cpu",)
    devices = tuple("cuda:0" if d == "cuda" else d for d in (part.strip() for part in spec.split(",")) if d)
    for device in devices:
        if device != "cpu" and not (device.startswith("cuda:") and device[5:].isdigit()):
            raise InputError(f"--devices {spec!r}: {device!r} is not cpu, cuda or cuda:N")
        if device.startswith("cuda") and int(device[5:]) >= (torch.cuda.device_count() if torch.cuda.is_available() else 0):
            raise InputError(f"--devices {spec!r}: {device} is not a visible GPU")
    if not devices:
        raise InputError("--devices is empty")
    return devices


# -- the queue (pure bookkeeping, no processes) -----------------------------------------------------
@dataclass
class WorkQueue:
    """Problems not yet handed out, those each worker holds, and the deaths each problem was part of."""

    pending: deque[Problem]
    held: dict[int, dict[int, Problem]] = field(default_factory=dict)
    strikes: Counter = field(default_factory=Counter)
    errors: dict[int, list[str]] = field(default_factory=dict)

    def take(self, worker: int) -> Problem | None:
        """The next problem for `worker`, or None: a suspect (part of a death) only to a worker holding
        nothing, and nothing more to a worker holding a suspect."""
        mine = self.held.setdefault(worker, {})
        if any(self.strikes[idx] for idx in mine):
            return None
        suspect = next((p for p in self.pending if self.strikes[p.idx]), None)
        choice = suspect if suspect is not None and not mine else next(
            (p for p in self.pending if not self.strikes[p.idx]), None)
        if choice is not None:
            self.pending.remove(choice)
            mine[choice.idx] = choice
        return choice

    def done(self, worker: int, idx: int) -> None:
        self.held.get(worker, {}).pop(idx, None)

    def lost(self, worker: int, error: str) -> list[Problem]:
        """`worker` died: its problems go back to the front of the queue; those struck out are returned."""
        failed = []
        for problem in reversed(list(self.held.pop(worker, {}).values())):
            self.strikes[problem.idx] += 1
            self.errors.setdefault(problem.idx, []).append(error)
            if self.strikes[problem.idx] >= STRIKES:
                failed.append(problem)
            else:
                self.pending.appendleft(problem)
        return failed

    @property
    def empty(self) -> bool:
        return not self.pending and not any(self.held.values())


# -- the worker process -----------------------------------------------------------------------------
def _pull(conn: Connection) -> Iterator[Problem]:
    while True:
        conn.send(("want",))
        message = conn.recv()
        if message[0] != "problem":
            return
        yield message[1]


def worker_main(conn: Connection, options: GridOptions, device: str, threads: int) -> None:
    """Load the grid's models on `device` once, then decode what the parent hands out until told to stop."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    die_with_parent()
    import torch

    from kvrescue_cli import decoding

    if device == "cpu":
        torch.set_num_threads(threads)
    else:
        torch.cuda.set_device(device)
    try:
        try:
            models = decoding.load_roles(options, device)
        except InputError as err:
            conn.send(("error", str(err)))
            return
        conn.send(("ready",))
        while True:
            message = conn.recv()
            if message[0] == "stop":
                return
            decoding.decode(options, message[1], models, _pull(conn),
                        lambda trace, tokens: conn.send(("trace", trace, tokens)))
            conn.send(("idle",))
    except EOFError:
        return  # the parent is gone
    except BaseException as err:
        conn.send(("crash", f"{type(err).__name__}: {err}"[:2000]))
        raise SystemExit(1) from None


# -- the parent's side ------------------------------------------------------------------------------
@dataclass
class _Worker:
    number: int
    device: str
    process: BaseProcess
    conn: Connection
    state: str = "loading"  # loading | idle | running
    last: int | None = None
    error: str | None = None

    @property
    def name(self) -> str:
        return f"worker {self.number} ({self.device}, pid {self.process.pid})"


class WorkerPool:
    """One worker process per device; `start` them before the first cell."""

    def __init__(self, options: GridOptions, say: Callable[[str], None]) -> None:
        self.options = options
        self.say = say
        self.context = get_context("spawn")
        self.workers: list[_Worker] = []
        self.deaths: Counter = Counter()
        self.last_errors: dict[str, str] = {}
        self.started = 0  # workers started so far (numbers them)

    def __enter__(self) -> WorkerPool:
        return self

    def __exit__(self, kind, *rest) -> None:
        for worker in self.workers:
            if kind is None and worker.state != "running":
                try:
                    worker.conn.send(("stop",))
                except OSError:
                    pass
            else:
                worker.process.terminate()
        for worker in self.workers:
            worker.process.join(10)
            if worker.process.is_alive():
                worker.process.kill()
                worker.process.join()
            worker.conn.close()
        self.workers = []

    def _start(self, device: str) -> None:
        cpu_workers = sum(d == "cpu" for d in self.options.devices)
        threads = max(1, (os.cpu_count() or 1) // max(cpu_workers, 1))
        parent, child = self.context.Pipe()
        process = self.context.Process(target=worker_main, args=(child, self.options, device, threads),
                                       name=f"kvrescue-worker-{self.started}")
        process.start()
        child.close()
        self.workers.append(_Worker(self.started, device, process, parent))
        self.started += 1

    def start(self) -> None:
        """Start one worker per device and wait until each holds the models: a configuration error (a
        missing model, say) raises here, before any run folder is opened."""
        for device in self.options.devices:
            self._start(device)
        idle = WorkQueue(deque())
        while any(w.state == "loading" for w in self.workers):
            self._wait(idle, None, lambda trace, tokens: None)
        if not self.workers:
            raise WorkersGone(f"no worker could start ({self._errors()})")

    def decode(self, cell: Cell, problems: list[Problem], emit: Callable[[Trace, int], None]) -> None:
        """Decode `problems` of `cell` on the workers, emitting every problem's trace exactly once."""
        queue = WorkQueue(deque(problems))
        slim = replace(cell, problems=replace(cell.problems, problems=[]))
        while True:
            for worker in self.workers:
                if worker.state == "idle" and queue.pending:
                    try:
                        worker.conn.send(("run", slim))
                        worker.state = "running"
                    except OSError:
                        pass  # it just died: its sentinel says so below
            if queue.empty and all(w.state != "running" for w in self.workers):
                return
            if not self.workers:
                raise WorkersGone(f"every worker is gone ({self._errors()}); {len(queue.pending)} problems of this "
                                  "cell are not done; what finished is written: run the same command again to resume")
            self._wait(queue, cell, emit)

    def _errors(self) -> str:
        return "; ".join(f"{device}: {error}" for device, error in self.last_errors.items())

    def _wait(self, queue: WorkQueue, cell: Cell | None, emit: Callable[[Trace, int], None]) -> None:
        """Wait for messages or deaths, then answer the messages and bury the dead."""
        handles = [w.conn for w in self.workers] + [w.process.sentinel for w in self.workers]
        ready = set(wait(handles))
        for worker in list(self.workers):
            if worker.conn in ready and self._serve(worker, queue, emit):
                continue
            if worker.process.sentinel in ready or not worker.process.is_alive():
                self._bury(worker, queue, cell, emit)

    def _serve(self, worker: _Worker, queue: WorkQueue, emit: Callable[[Trace, int], None]) -> bool:
        """Answer everything `worker` sent; False when its pipe closed (it is dying)."""
        try:
            while worker.conn.poll():
                kind, *body = worker.conn.recv()
                if kind == "want":
                    problem = queue.take(worker.number)
                    worker.conn.send(("none",) if problem is None else ("problem", problem))
                    worker.last = worker.last if problem is None else problem.idx
                elif kind == "trace":
                    trace, tokens = body
                    queue.done(worker.number, trace.idx)
                    emit(trace, tokens)
                elif kind in ("ready", "idle"):
                    worker.state = "idle"
                elif kind == "crash":
                    worker.error = body[0]
                elif kind == "error":
                    raise InputError(body[0])
        except (EOFError, OSError):
            worker.process.join(10)
            return False
        return True

    def _bury(self, worker: _Worker, queue: WorkQueue, cell: Cell | None, emit: Callable[[Trace, int], None]) -> None:
        """Record a dead worker: requeue its problems, fail those struck out, restart its device."""
        self._serve(worker, queue, emit)  # traces it sent before dying still count
        worker.process.join(10)
        code = worker.process.exitcode
        error = worker.error or (f"killed by {signal.Signals(-code).name}" if code is not None and code < 0
                                 else f"exit status {code}")
        holding = sorted(queue.held.get(worker.number, {}))
        failed = queue.lost(worker.number, error)
        self.workers.remove(worker)
        worker.conn.close()
        self.deaths[worker.device] += 1
        self.last_errors[worker.device] = error
        restart = self.deaths[worker.device] < DEVICE_RESTARTS
        self.say(f"{worker.name} died ({error}) holding problems {holding or 'none'}; last problem given: "
                 f"{worker.last}; " + (f"starting a new worker on {worker.device}" if restart
                                       else f"{worker.device} died {self.deaths[worker.device]} times: no new worker"))
        for problem in failed:  # a queue holding problems comes with their cell
            errors = queue.errors[problem.idx]
            gt_norm = grade("", problem.gt, cell.problems.grading_bench).gt
            emit(Trace.failed(problem.idx, problem.problem, problem.gt, gt_norm,
                              f"killed {len(errors)} workers: " + "; ".join(errors)), 0)
            self.say(f"problem {problem.idx} killed {len(errors)} workers: recorded as failed")
        if restart:
            self._start(worker.device)
