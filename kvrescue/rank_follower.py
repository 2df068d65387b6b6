"""A rank > 0 of a device group (`python -m kvrescue.rank_follower`, started by `rank_group.RankGroup`): it
loads its shards of the grid's models, then decodes every cell rank 0 sends, dropping the traces."""

from __future__ import annotations

import os
import pickle
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import torch.distributed as dist

from kvrescue.cell_runners import build_cell
from kvrescue.decoding import decode_cell
from kvrescue.group_models import load_roles
from kvrescue.rank_group import join, receive, remove_folder

if TYPE_CHECKING:
    from kvrescue.data import Problem


def _exit_with(parent: int, folder: Path) -> None:
    """End this process soon after `parent` (rank 0) is gone (it may die without a word, SIGKILLed), removing the
    group's folder, which rank 0 can no longer remove."""
    def watch() -> None:
        while True:
            try:
                os.kill(parent, 0)
            except ProcessLookupError:
                remove_folder(folder)
                os._exit(1)
            time.sleep(0.5)

    threading.Thread(target=watch, daemon=True).start()


def follow(folder: Path, rank: int, device: str, world: int, parent: int) -> None:
    """Load this rank's shards, then decode every cell rank 0 sends, until told to stop."""
    _exit_with(parent, folder)
    options = pickle.loads((folder / "options.pickle").read_bytes())
    join(folder / "rendezvous", rank, world, device)
    models = load_roles(options.group_plan(), device)
    pipe = sys.stdin.buffer  # rank 0's messages

    def problems() -> Iterator[Problem]:
        while (message := receive(pipe))[0] == "problem":
            yield message[1]

    try:
        while (message := receive(pipe))[0] == "cell":
            plan = options.plan_of(message[1])
            decode_cell(plan, message[1], build_cell(plan, models), problems(), lambda trace, tokens: None)
    except SystemExit:  # rank 0's pipe closed: it is gone, or closing the group after a rank died
        remove_folder(folder)
        raise
    dist.destroy_process_group()


if __name__ == "__main__":
    folder, rank, device, world, parent = sys.argv[1:]
    follow(Path(folder), int(rank), device, int(world), int(parent))
