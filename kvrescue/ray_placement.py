"""Where Ray places a device group's actor: the GPUs the private Ray instance is shown, what each actor asks Ray for,
the devices of its group as the actor names them, and its compute threads on a CPU."""

from __future__ import annotations

import os

from kvrescue.devices import device_shares, gpu_index, is_cpu
from kvrescue.errors import InputError


def named_gpus(groups: list[tuple[str, ...]], visible: str | None) -> list[str]:
    """The CUDA_VISIBLE_DEVICES entries of the GPUs named (`cuda:N` is the N-th of `visible`, if set)."""
    indices = sorted({gpu_index(d) for group in groups for d in group if gpu_index(d) is not None})
    ids = visible.split(",") if visible else [str(i) for i in range(max(indices, default=-1) + 1)]
    return [ids[i] for i in indices]


def actor_resources(groups: list[tuple[str, ...]], group: int) -> dict[str, float]:
    """What the actor of `groups[group]` asks Ray for: a CPU, and its GPUs; a local GPU named by several
    groups (`cuda:0,cuda:0`) is shared, each taking its fraction of it."""
    devices = groups[group]
    if is_cpu(devices[0]):
        return {"num_cpus": 1, "num_gpus": 0}
    shares = device_shares(groups, group)
    if shares > 1 and len(devices) > 1:  # Ray gives a share below 1 of one GPU only
        raise InputError(f"--devices {','.join(d for g in groups for d in g)}: the group {','.join(devices)} shares "
                         f"its GPUs with another group; groups of --tp {len(devices)} need GPUs of their own")
    return {"num_cpus": 1, "num_gpus": len(devices) / shares}


def actor_devices(group: tuple[str, ...], gpu_ids: list, visible: str | None) -> tuple[str, ...]:
    """The devices of `group` as its actor names them. Ray shows an actor only the GPUs it assigned it, setting
    its CUDA_VISIBLE_DEVICES to their IDs (`ray.get_gpu_ids()`), so the actor's r-th GPU is `cuda:k`, k the place
    of its ID in `visible` (the actor's CUDA_VISIBLE_DEVICES), or the ID itself where Ray left that unset
    (RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES). Which of the named GPUs a group gets is Ray's choice (its
    placement is recorded in config.json)."""
    if is_cpu(group[0]):
        return group
    ids = [str(i) for i in gpu_ids]
    if len(ids) < len(group):
        raise RuntimeError(f"Ray gave the actor of {','.join(group)} {len(ids)} GPU(s) for its {len(group)} ranks")
    order = visible.split(",") if visible is not None else None
    return tuple(f"cuda:{order.index(i) if order is not None else int(i)}" for i in ids[:len(group)])


def cpu_threads(groups: list[tuple[str, ...]]) -> int:
    """Compute threads of an actor on a CPU group: `OMP_NUM_THREADS` where this process's environment sets it (as
    every process of an in-process run computes), else an equal share of this machine's cores."""
    named = os.environ.get("OMP_NUM_THREADS", "")
    if named.isdigit() and int(named) > 0:
        return int(named)
    return max(1, (os.cpu_count() or 1) // max(sum(is_cpu(g[0]) for g in groups), 1))
