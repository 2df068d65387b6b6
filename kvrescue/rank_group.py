"""A device group of K devices under `--tp K`: K processes decoding in lockstep over torch.distributed.

Rank 0 is the group's worker (the `kvrescue run` process, or the group's Ray actor). It starts ranks
1..K-1 as child processes on the other devices of the group; every rank loads its shards of the grid's
models (`group_models.load_roles` with `options.tp`, gloo on the CPU, NCCL on CUDA). Rank 0 alone talks to
the driver: it sends each cell it starts and each problem it pulls (then "end") down a pipe to each other rank
(`rank_follower.py`), which runs the same `decoding.decode_cell` on what it receives and drops its traces. The
controller is deterministic given its problems, logits and scores, every rank holds the same logits (the LM head
gathers them), and what copies of a model on different ranks could disagree on (sampled tokens, scores) comes
from rank 0 (`tp.from_rank_0`, `cell_runners.RankZeroScores`), so every rank issues the same collectives.

Between cells a rank > 0 waits on its pipe, without a timeout, as long as rank 0 lives (a Ray actor waits for the
driver's next cell until the slowest actor has finished this one, hours maybe); collectives inside a cell fail
the group after TIMEOUT. A rank that dies makes the next collective of the others fail (gloo), so rank 0 raises
and its group is restarted like any dead worker; the other ranks exit when rank 0's process is gone. Each other
rank's stderr goes to a file in the group's folder: an error of the group names every rank that has exited, its
exit status and the last lines it wrote (`RankGroup.explained`). Rank 0 removes the folder when it closes the group
(or fails to form it); when rank 0 is gone without closing it (a Ray actor is killed, at the end of a run too), the
other ranks remove it as they exit (`remove_folder`).
"""

from __future__ import annotations

import os
import pickle
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO

import torch.distributed as dist

from kvrescue.devices import is_gpu
from kvrescue.engine.tp import forget_groups
from kvrescue.group_models import use_device

if TYPE_CHECKING:
    from kvrescue.data import Problem
    from kvrescue.cell_plan import Cell

# A collective that waits longer than this fails the group ($KVRESCUE_TP_TIMEOUT_S seconds, default 10 minutes).
TIMEOUT = timedelta(seconds=float(os.environ.get("KVRESCUE_TP_TIMEOUT_S", "600")))
EXIT_WAIT_S = 2.0  # how long a failed rank 0 waits for a dying rank to be gone before telling which ranks have exited
STDERR_TAIL = 1200  # characters of an exited rank's stderr an error of its group quotes


class RankGone(RuntimeError):
    """An error inside a group where another rank has exited; the message says why (its status, its stderr)."""


def join(rendezvous: Path, rank: int, world: int, device: str) -> None:
    """Join the group's process group."""
    use_device(device)
    backend = "nccl" if is_gpu(device) else "gloo"
    dist.init_process_group(backend, init_method=f"file://{rendezvous}", rank=rank, world_size=world, timeout=TIMEOUT)


class RankGroup:
    """Rank 0 of a K-device group: starts the other ranks and leads them. Rank r computes on `group[r]`, a device
    named as this process sees it (the run's `--devices` in the `kvrescue run` process; `ray_placement.actor_devices`
    in a Ray actor); the other ranks inherit this process's CUDA_VISIBLE_DEVICES, so the names hold there too."""

    def __init__(self, options: object, group: tuple[str, ...]) -> None:
        """`options`: what every rank loads its models and decodes with (`rank_follower` reads them, pickled)."""
        self.folder = Path(tempfile.mkdtemp(prefix="kvrescue-tp-"))
        self.followers: list[subprocess.Popen] = []
        try:
            (self.folder / "options.pickle").write_bytes(pickle.dumps(options))
            for rank in range(1, len(group)):
                self.followers.append(self._start(rank, group))
            join(self.folder / "rendezvous", 0, len(group), group[0])
        except BaseException:  # no group: its ranks and folder go with the error
            for follower in self.followers:
                follower.kill()
                follower.wait()
            remove_folder(self.folder)
            raise

    def _start(self, rank: int, group: tuple[str, ...]) -> subprocess.Popen:
        with open(self.folder / f"rank{rank}.stderr", "wb") as stderr:
            return subprocess.Popen([sys.executable, "-m", "kvrescue.rank_follower", str(self.folder), str(rank),
                                     group[rank], str(len(group)), str(os.getpid())],
                                    stdin=subprocess.PIPE, stderr=stderr)

    def exits(self) -> str:
        """Every other rank that has exited (waiting up to EXIT_WAIT_S for one dying): its exit status and the
        last lines of its stderr; empty if all live."""
        deadline = time.monotonic() + EXIT_WAIT_S
        while any(f.poll() is None for f in self.followers) and time.monotonic() < deadline:
            time.sleep(0.05)
        accounts = []
        for rank, follower in enumerate(self.followers, start=1):
            if follower.returncode is None:
                continue
            status = (f"was killed by signal {-follower.returncode}" if follower.returncode < 0
                      else f"exited with status {follower.returncode}")
            tail = (self.folder / f"rank{rank}.stderr").read_bytes()[-STDERR_TAIL:].decode(errors="replace")
            accounts.append(f"rank {rank} (pid {follower.pid}) {status}"
                            + (f", its stderr ending: {' | '.join(tail.strip().splitlines())}" if tail.strip() else ""))
        return "; ".join(accounts)

    @contextmanager
    def explained(self) -> Iterator[None]:
        """Re-raise an error raised inside (a broken pipe to a rank, a failed collective) as RankGone naming the
        other ranks that have exited, with why (`exits`), where any has: first, since a worker's error is cut short."""
        try:
            yield
        except Exception as err:
            exits = self.exits()
            if not exits:
                raise
            raise RankGone(f"{exits} (rank 0 then raised {type(err).__name__}: {err})") from err

    def _send(self, message: tuple) -> None:
        """`message` down every other rank's pipe (a dead rank's raises BrokenPipeError: the group has failed)."""
        data = pickle.dumps(message)
        for follower in self.followers:
            follower.stdin.write(len(data).to_bytes(8, "little") + data)
            follower.stdin.flush()

    def lead(self, cell: Cell, problems: Iterable[Problem]) -> Iterator[Problem]:
        """`problems`, each one sent to the other ranks as it is pulled (and `cell` first)."""
        self._send(("cell", cell))
        for problem in problems:
            self._send(("problem", problem))
            yield problem
        self._send(("end",))

    def close(self) -> None:
        """Tell the other ranks to exit, and wait for them (after a rank died: without raising over the group's
        error, which says why)."""
        try:
            self._send(("stop",))
        except BrokenPipeError:  # a rank is gone: the others exit as their pipes close below
            pass
        finally:
            for follower in self.followers:
                try:
                    follower.stdin.close()
                except OSError:  # it is gone already
                    pass
                try:
                    follower.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    follower.kill()
            dist.destroy_process_group()
            forget_groups()
            remove_folder(self.folder)


@contextmanager
def leading(ranks: RankGroup | None, cell: Cell, problems: Iterable[Problem]) -> Iterator[Iterable[Problem]]:
    """`problems` as a cell's decode pulls them: with a --tp group (`ranks`), each also sent to its other ranks
    (`RankGroup.lead`) and a dead rank's account in any error raised inside (`RankGroup.explained`)."""
    if ranks is None:
        yield problems
        return
    with ranks.explained():
        yield ranks.lead(cell, problems)


def remove_folder(folder: Path) -> None:
    """Remove a group's folder (its options, rendezvous and ranks' stderr), whichever rank gets there first."""
    shutil.rmtree(folder, ignore_errors=True)


def receive(pipe: BinaryIO) -> tuple:
    """A rank > 0: the next message rank 0 sent down `pipe`, waiting for it as long as rank 0 lives."""
    head = pipe.read(8)
    if len(head) < 8:
        raise SystemExit("rank 0 of the group is gone")
    return pickle.loads(pipe.read(int.from_bytes(head, "little")))
