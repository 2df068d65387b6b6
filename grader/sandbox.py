"""Killable worker processes for the comparisons that need sympy.

A worker imports sympy once, says it is ready, then answers `math_equal(pred, gt)` requests one at a
time. The parent gives each request a wall-clock limit counted from when it is sent; a worker that
overruns (or dies) is killed, its request is reported as `None`, and a fresh worker takes its place.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import subprocess
import sys
import time
from collections import deque
from collections.abc import Sequence
from multiprocessing.connection import wait
from pathlib import Path

_READY = "ready"
_STARTUP_LIMIT_S = 120.0
_MEMORY_LIMIT_BYTES = 4 << 30


def _die_with_parent() -> None:
    """Ask Linux to kill this worker when its parent dies, even mid-computation (no-op elsewhere)."""
    parent = os.getppid()
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # 1 = PR_SET_PDEATHSIG
    except (AttributeError, OSError):
        return
    if os.getppid() != parent:  # the parent died before the request took effect
        os._exit(1)


def serve() -> None:
    """Worker loop: answer JSON `[pred, gt]` lines on stdin with `true`/`false` lines until EOF."""
    import resource

    _die_with_parent()

    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    limit = _MEMORY_LIMIT_BYTES if hard == resource.RLIM_INFINITY else min(_MEMORY_LIMIT_BYTES, hard)
    if soft == resource.RLIM_INFINITY or soft > limit:
        resource.setrlimit(resource.RLIMIT_AS, (limit, hard))
    # Keep the answer channel to ourselves: anything a library prints goes to stderr.
    answers = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)

    from grader.equal import math_equal
    from grader.symbolic import symbolic_equal

    # Warm the parsers up (the first parse_latex call alone takes about a second) so that the time
    # limit measures comparisons, not start-up.
    math_equal("\\frac{x^2}{2}", "0.5x*x", symbolic_equal)
    symbolic_equal("\\frac{(}{", "1")  # rejected by parse_latex: warms parse_expr and latex2sympy
    answers.write(_READY + "\n")
    answers.flush()
    for line in sys.stdin:
        pred, gt = json.loads(line)
        try:
            verdict = math_equal(pred, gt, symbolic_equal)
        except Exception:  # scored incorrect (the reference harness would stop at this point)
            verdict = False
        answers.write(json.dumps(verdict) + "\n")
        answers.flush()


class _Slot:
    """One worker process and the request it is running, if any."""

    def __init__(self) -> None:
        self.process: subprocess.Popen[str] | None = None
        self.ready = False
        self.task: int | None = None
        self.deadline = 0.0
        self.started = 0.0

    def start(self) -> None:
        # A fresh interpreter (not fork: the caller may hold threads; not multiprocessing's spawn: it
        # re-runs the caller's main script). The package's parent folder goes on its import path.
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(Path(__file__).resolve().parents[1]), env.get("PYTHONPATH")]))
        self.process = subprocess.Popen(
            [sys.executable, "-c", "from grader.sandbox import serve; serve()"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        self.ready, self.task, self.started = False, None, time.monotonic()

    def send(self, task: int, pair: tuple[str, str], timeout: float) -> None:
        self.task = task
        self.process.stdin.write(json.dumps(pair) + "\n")
        self.process.stdin.flush()
        self.deadline = time.monotonic() + timeout

    def stop(self) -> None:
        if self.process is not None:
            self.process.kill()
            self.process.wait()
            self.process.stdin.close()
            self.process.stdout.close()
        self.process, self.ready, self.task = None, False, None


class SymbolicPool:
    """Worker processes for `math_equal` with the sympy test, each request under a hard time limit."""

    def __init__(self) -> None:
        self._slots: list[_Slot] = []

    def compare(self, pairs: Sequence[tuple[str, str]], timeout: float, workers: int = 1) -> list[bool | None]:
        """Verdicts for (pred, gt) pairs in order; None where the limit ran out or the worker died."""
        results: list[bool | None] = [None] * len(pairs)
        pending = deque(range(len(pairs)))
        while len(self._slots) < workers:
            self._slots.append(_Slot())
        slots = self._slots[:workers]
        outstanding = len(pairs)
        while outstanding:
            for slot in slots:
                if slot.process is None:
                    slot.start()
                if slot.ready and slot.task is None and pending:
                    task = pending.popleft()
                    slot.send(task, pairs[task], timeout)
            live = [s for s in slots if s.process is not None]
            horizon = min(
                [s.deadline for s in live if s.task is not None]
                + [s.started + _STARTUP_LIMIT_S for s in live if not s.ready]
            )
            readable = wait([s.process.stdout for s in live], max(0.0, horizon - time.monotonic()))
            for slot in live:
                outstanding -= self._collect(slot, slot.process.stdout in readable, results)
        return results

    def _collect(self, slot: _Slot, readable: bool, results: list[bool | None]) -> int:
        """Take what `slot` has to say; returns how many requests it finished (0 or 1)."""
        line = slot.process.stdout.readline() if readable else None
        if line == _READY + "\n":
            slot.ready = True
            return 0
        if line:
            results[slot.task] = json.loads(line)
            slot.task = None
            return 1
        now = time.monotonic()
        if line is None and slot.task is None and not slot.ready and now >= slot.started + _STARTUP_LIMIT_S:
            raise RuntimeError(f"grader symbolic worker did not start within {_STARTUP_LIMIT_S:.0f} s")
        if line is None and (slot.task is None or now < slot.deadline):
            return 0
        # Overran its limit, or the pipe closed (the worker died).
        if not slot.ready:
            raise RuntimeError(f"grader symbolic worker exited during start-up (exit code {slot.process.poll()})")
        finished = int(slot.task is not None)
        slot.stop()
        slot.start()  # right away, so the replacement warms up while others work
        return finished

    def close(self) -> None:
        """Stop every worker; the pool starts new ones if used again."""
        for slot in self._slots:
            slot.stop()
        self._slots.clear()
