"""A device group of K devices under `--tp K`: K processes decoding in lockstep over torch.distributed.

Rank 0 is the group's worker (the `kvrescue run` process, or the group's Ray actor). It starts ranks
1..K-1 as child processes on the other devices of the group; every rank loads its shards of the grid's
models (`decoding.load_roles` with `options.tp`, gloo on the CPU, NCCL on CUDA). Rank 0 alone talks to
the driver: it broadcasts each cell it starts and each problem it pulls (None after the last), over a
gloo group kept for these messages, and the other ranks (`rank_follower.py`) run the same `decoding.decode` on
what it broadcasts and drop their traces. The controller is deterministic given its problems and logits, and
every rank holds the same logits (the LM head gathers them), so every rank issues the same collectives.

A rank that dies makes the next collective of the others fail (gloo), so rank 0 raises and its group is
restarted like any dead worker; the other ranks exit when rank 0's process is gone.
"""

from __future__ import annotations

import os
import pickle
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from kvrescue_cli.data import Problem
    from kvrescue_cli.grid import Cell, GridOptions

TIMEOUT = timedelta(minutes=10)  # a collective that waits longer than this fails the group


def join(rendezvous: Path, rank: int, world: int, device: str) -> Any:
    """Join the group's process group; the gloo group that carries rank 0's messages."""
    if device != "cpu":
        torch.cuda.set_device(device)
    backend = "gloo" if device == "cpu" else "nccl"
    dist.init_process_group(backend, init_method=f"file://{rendezvous}", rank=rank, world_size=world, timeout=TIMEOUT)
    return dist.group.WORLD if backend == "gloo" else dist.new_group(backend="gloo", timeout=TIMEOUT)


class RankGroup:
    """Rank 0 of a K-device group: starts the other ranks and leads them. Rank r computes on `group[r]`, a device
    named as this process sees it (the run's `--devices` in the `kvrescue run` process; `workers.actor_devices`
    in a Ray actor); the other ranks inherit this process's CUDA_VISIBLE_DEVICES, so the names hold there too."""

    def __init__(self, options: GridOptions, group: tuple[str, ...]) -> None:
        self.folder = Path(tempfile.mkdtemp(prefix="kvrescue-tp-"))
        (self.folder / "options.pickle").write_bytes(pickle.dumps(options))
        rendezvous = self.folder / "rendezvous"
        self.followers = [
            subprocess.Popen([sys.executable, "-m", "kvrescue_cli.rank_follower", str(self.folder), str(rank),
                              group[rank], str(len(group)), str(os.getpid())])
            for rank in range(1, len(group))
        ]
        self.control = join(rendezvous, 0, len(group), group[0])

    def _send(self, message: tuple) -> None:
        dist.broadcast_object_list([message], src=0, group=self.control)

    def lead(self, cell: Cell, problems: Iterable[Problem]) -> Iterator[Problem]:
        """`problems`, each one broadcast to the other ranks as it is pulled (and `cell` first)."""
        self._send(("cell", cell))
        for problem in problems:
            self._send(("problem", problem))
            yield problem
        self._send(("end",))

    def close(self) -> None:
        """Tell the other ranks to exit, and wait for them."""
        try:
            self._send(("stop",))
        finally:
            for follower in self.followers:
                try:
                    follower.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    follower.kill()
            dist.destroy_process_group()
            shutil.rmtree(self.folder, ignore_errors=True)


def receive(control: Any) -> tuple:
    """A rank > 0: the next message rank 0 broadcasts."""
    message = [None]
    dist.broadcast_object_list(message, src=0, group=control)
    return message[0]
