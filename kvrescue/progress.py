"""What `kvrescue run` shows while it decodes: a live bar on a terminal, plain lines in a log file.

Both show, per cell, the problems done of its total, accuracy so far, steps and tokens per second and an ETA, the
rate and ETA computed here from this invocation's own problems (rich's estimate forgets samples older than 30 s, so
on a slow CPU, where problems finish minutes apart, it never shows one).
"""

from __future__ import annotations

import time
from datetime import timedelta
from typing import Any

from rich.console import Console

LOG_EVERY_S = 30.0  # a plain line at most this often while a cell decodes (and one when it starts and ends)


def rate(count: int, elapsed: float, unit: str) -> str:
    """`count` per second over `elapsed`, as seconds per unit below one a second; `-` before the first (never a
    `0.0` that reads as stuck)."""
    if count == 0:
        return f"- {unit}/s"
    per_s = count / max(elapsed, 1e-9)
    return f"{per_s:.1f} {unit}/s" if per_s >= 1 else f"{elapsed / count:.1f} s/{unit}"


class CellRate:
    """One cell's speed and ETA from what this invocation decoded: problems finished, steps and tokens generated
    (the larger of the finished problems' sums and the controller's running totals, which include problems in
    flight but may lag the last one finished)."""

    def __init__(self, total: int, done: int) -> None:
        self.started, self.total, self.done_before, self.done = time.monotonic(), total, done, done
        self.finished_steps = self.finished_tokens = self.live_steps = self.live_tokens = 0

    def finished(self, steps: int, tokens: int) -> None:
        """A problem is done: its committed steps and generated tokens."""
        self.done += 1
        self.finished_steps, self.finished_tokens = self.finished_steps + steps, self.finished_tokens + tokens

    def in_flight(self, steps: int, tokens: int) -> None:
        """The controller's running totals."""
        self.live_steps, self.live_tokens = steps, tokens

    def fields(self) -> dict[str, str]:
        """The `speed` and `eta` texts the bar and the log lines show."""
        elapsed = time.monotonic() - self.started
        steps, tokens = max(self.finished_steps, self.live_steps), max(self.finished_tokens, self.live_tokens)
        finished = self.done - self.done_before
        left = self.total - self.done
        if not left:
            eta = "done"
        elif finished:
            eta = f"eta {timedelta(seconds=round(elapsed / finished * left))}"
        else:
            eta = "eta after the first problem"
        return {"speed": f"{rate(steps, elapsed, 'step')} {rate(tokens, elapsed, 'tok')}", "eta": eta}


class LogLines:
    """A stand-in for `rich.progress.Progress` where stderr is no terminal (nohup, SLURM, `2> log`): a plain line
    when a cell starts, at most every `LOG_EVERY_S` seconds while it decodes, and when its last problem is done."""

    def __init__(self, console: Console, every_s: float = LOG_EVERY_S) -> None:
        self.console, self.every_s = console, every_s
        self.tasks: list[dict[str, Any]] = []

    def __enter__(self) -> LogLines:
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    def add_task(self, description: str, total: int, completed: int = 0, **fields: str) -> int:
        self.tasks.append({"description": description, "total": total, "completed": completed, "said": 0.0, **fields})
        if completed < total:  # a complete cell: `run_cell` says so
            self._say(len(self.tasks) - 1)
        return len(self.tasks) - 1

    def update(self, task: int, advance: int = 0, **fields: str) -> None:
        state = self.tasks[task]
        state.update(fields, completed=state["completed"] + advance)
        if (advance and state["completed"] >= state["total"]) or time.monotonic() - state["said"] >= self.every_s:
            self._say(task)

    def _say(self, task: int) -> None:
        state = self.tasks[task]
        state["said"] = time.monotonic()
        shown = ", ".join(state[k] for k in ("accuracy", "speed", "eta") if state.get(k))
        self.console.print(f"{time.strftime('%H:%M:%S')} {state['description']}: {state['completed']}/"
                           f"{state['total']} problems" + (f", {shown}" if shown else ""),
                           markup=False, highlight=False, soft_wrap=True)
