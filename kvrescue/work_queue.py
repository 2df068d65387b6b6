"""The driver's bookkeeping of a cell's problems over the Ray actors (pure, no processes): what is not yet handed
out, what each actor holds, and the deaths each problem was part of (`workers.RayWorkers` requeues a dead actor's
problems and records as failed those part of STRIKES deaths)."""

from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass, field

from kvrescue.data import Problem

STRIKES = 2          # actor deaths a problem may be part of before it is recorded as failed


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
