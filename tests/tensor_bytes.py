"""Live bytes of the tensors a piece of code allocates, and their peak, measured on the CPU.

`TensorBytes` is a TorchDispatchMode: every aten op's outputs pass through it, so it sees each new storage
(an output whose storage none of the op's inputs hold) and counts its bytes until the last tensor viewing it
is gone (a weak-reference finalizer per tensor). Storages that existed before it started (model weights)
are never counted, nor are views of them. What the planner (`kvrescue/memory_plan.py`) predicts for a
cell is compared against `peak`.
"""

from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode


def _key(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def _tensors(value) -> list[torch.Tensor]:
    """The tensors among an aten op's arguments or outputs: tensors, in (nested) tuples, lists and dict values, the
    only containers aten schemas take and return (torch.utils._pytree's walk, at a fraction of its cost per op)."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for item in value for t in _tensors(item)]
    if isinstance(value, dict):
        return [t for item in value.values() for t in _tensors(item)]
    return []


class TensorBytes(TorchDispatchMode):
    """Bytes of the storages allocated while the mode is active and still alive (`live`), and their `peak`."""

    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self.storages: dict[int, list[int]] = {}  # data_ptr -> [tensors alive viewing it, its bytes]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {_key(t) for t in _tensors((args, kwargs))}
        for t in _tensors(out):
            if t.device.type == "cpu":
                self._track(t, inputs)
        return out

    def _track(self, t: torch.Tensor, inputs: set[int]) -> None:
        key = _key(t)
        entry = self.storages.get(key)
        if entry is None:
            size = t.untyped_storage().nbytes()
            if key in inputs or size == 0:
                return  # a view of (or in-place op on) a storage from before the mode: not counted
            entry = self.storages[key] = [0, size]
            self.live += size
            self.peak = max(self.peak, self.live)
        entry[0] += 1
        weakref.finalize(t, self._drop, key)

    def _drop(self, key: int) -> None:
        entry = self.storages[key]
        entry[0] -= 1
        if entry[0] == 0:
            self.live -= entry[1]
            del self.storages[key]


def parameter_bytes(*modules: torch.nn.Module) -> int:
    """Bytes of the modules' parameters and buffers, each storage once (tied weights, a model shared by roles)."""
    storages = {}
    for module in modules:
        for t in [*module.parameters(), *module.buffers()]:
            storages[_key(t)] = t.untyped_storage().nbytes()
    return sum(storages.values())
