"""The Ray actor of one device group (`workers.py` has the driver and the messages between them): the grid's models
loaded once on its devices (rank 0 of its group under `--tp`), and a thread decoding the problems the driver hands
out, one at a time, into traces sent back."""

from __future__ import annotations

import os
import queue
import threading
from typing import TYPE_CHECKING, Iterator

from kvrescue.cell_runners import build_cell
from kvrescue.data import Problem
from kvrescue.decoding import decode_cell
from kvrescue.device_plan import wait_for_room
from kvrescue.devices import is_cpu
from kvrescue.errors import InputError
from kvrescue.group_models import load_roles
from kvrescue.rank_group import RankGroup, leading, remove_folder
from kvrescue.ray_placement import actor_devices

if TYPE_CHECKING:
    from kvrescue.cell_plan import Cell
    from kvrescue.grid import GridOptions

RELEASE_WAIT_S = 60.0  # how long a restarted actor waits for its dead predecessor's device memory to be released


class GroupWorker:
    """A Ray actor: one device group's models, and a thread decoding the problems the driver hands out."""

    def __init__(self, options: GridOptions, group: tuple[str, ...], threads: int, shares: int = 1,
                 restarted: bool = False) -> None:
        """`shares`: workers sharing this group's devices (each plans its share); `restarted`: a dead worker of the
        group came before, whose memory the device may take a while to release (its check waits up to
        RELEASE_WAIT_S for it)."""
        import ray
        import torch

        self.options, plan = options, options.group_plan()
        self.outbox: queue.Queue = queue.Queue()
        self.inbox: queue.Queue = queue.Queue()
        group = actor_devices(group, ray.get_gpu_ids(), os.environ.get("CUDA_VISIBLE_DEVICES"))
        device = group[0]
        if is_cpu(device):
            torch.set_num_threads(threads)
        placement = {"node": ray.util.get_node_ip_address(), "node_id": ray.get_runtime_context().get_node_id(),
                     "pid": os.getpid(), "gpus": [str(g) for g in ray.get_gpu_ids()]}
        self.ranks: RankGroup | None = None
        try:  # the memory check before the group forms: a refusal inside it would hang its ranks
            wait_for_room(plan, group, shares, RELEASE_WAIT_S if restarted else 0.0)
            self.ranks = RankGroup(options, group) if len(group) > 1 else None  # --tp: this actor is rank 0
            self.models = load_roles(plan, device)
            self.outbox.put(("ready", placement))
        except InputError as err:
            self.close()
            self.outbox.put(("error", str(err)))

    def close(self) -> None:
        """Close this actor's --tp group, if any: Ray kills an actor's child processes with it, so its other ranks
        could not remove the group's folder."""
        if self.ranks is not None:
            self.ranks.close()
            self.ranks = None

    def begin(self, cell: Cell) -> None:
        """Start decoding problems of `cell`, asking the driver for them."""
        threading.Thread(target=self._decode, args=(cell,), daemon=True).start()

    def exchange(self, replies: list[tuple]) -> list[tuple]:
        """Take the driver's replies, then wait for this actor's next messages and return them all."""
        for reply in replies:
            self.inbox.put(reply)
        messages = [self.outbox.get()]
        while not self.outbox.empty():
            messages.append(self.outbox.get())
        return messages

    def _pull(self) -> Iterator[Problem]:
        while True:
            self.outbox.put(("want",))
            reply = self.inbox.get()
            if reply[0] != "problem":
                return
            yield reply[1]

    def _decode(self, cell: Cell) -> None:
        try:
            plan = self.options.plan_of(cell)
            with leading(self.ranks, cell, self._pull()) as problems:
                decode_cell(plan, cell, build_cell(plan, self.models), problems,
                            lambda trace, tokens: self.outbox.put(("trace", trace, tokens)),
                            lambda totals: self.outbox.put(("progress", totals.committed_steps,
                                                            totals.generated_tokens)))
            self.outbox.put(("idle",))
        except BaseException as err:
            if self.ranks is not None:  # the driver kills a crashed actor; a killed rank cannot remove the folder
                remove_folder(self.ranks.folder)
            self.outbox.put(("crash", f"{type(err).__name__}: {err}"[:2000]))
