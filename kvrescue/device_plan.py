"""The grid's memory plan against a device: how much of it a worker may plan for, `--batch auto`, and one-line
errors, before any weights are read, for a plan that does not fit (memory_plan.py computes the plans). Everything here
reads the grid's `cell_plan.GroupPlan`."""

from __future__ import annotations

import importlib.util
import time
from typing import Callable

import psutil
import torch

from kvrescue import memory_fit
from kvrescue import memory_plan as planner
from kvrescue.cell_plan import GroupPlan
from kvrescue.devices import is_gpu
from kvrescue.dtypes import dtype_bytes
from kvrescue.run_options import Placement
from kvrescue.vllm_engine.roles import EngineSpec, engine_specs
from kvrescue.vllm_engine.shares import engine_shares


def device_kind(group: GroupPlan, device: str) -> planner.DeviceKind:
    """How the engine computes on `device` for the planner: its kernels follow the device, dtype, flash-attn and
    --deterministic."""
    engine, cuda, size = group.engine, is_gpu(device), dtype_bytes(group.engine.dtype)
    flash = cuda and size == 2 and importlib.util.find_spec("flash_attn") is not None
    return planner.DeviceKind(cuda, size, flash, engine.cuda_graphs, group.placement.tp, engine.deterministic)


def plan_for_device(group: GroupPlan, device: str = "cuda:0", batch: int | None = None) -> planner.DevicePlan | None:
    """One device's plan for the grid's largest cell (`batch`: in place of --batch); None when a model has no
    readable config (the loader then says why)."""
    return planner.readable_plan(group.cells, group.native_models(), device_kind(group, device), batch)


def device_memory(device: str, given: int | None = None) -> tuple[int, int]:
    """(free, total) bytes of a GPU, or of RAM (available, total) for the CPU; `given` (--device-memory) stands for
    both."""
    if given is not None:
        return given, given
    if is_gpu(device):
        return torch.cuda.mem_get_info(torch.device(device))
    ram = psutil.virtual_memory()
    return ram.available, ram.total


def device_room(group: GroupPlan, device: str, shares: int = 1, context: bool = True) -> int:
    """Bytes of `device` this worker may plan for: what is free of it (`context=False`: its total, read without
    creating a CUDA context, for a driver whose workers run elsewhere), at most its 1/`shares` (a device named by
    `shares` workers, `--devices cuda:0,cuda:0`), less vLLM's share of it with `--engine vllm`."""
    given, engine = group.placement.device_memory, group.engine
    if not context and given is None and is_gpu(device):
        free = total = torch.cuda.get_device_properties(torch.device(device)).total_memory
    else:
        free, total = device_memory(device, given)
    vllm = int(engine.vllm_memory * total) if engine.engine == "vllm" else 0
    return min(free - vllm, total // shares)


def group_room(group: GroupPlan, devices: tuple[str, ...], shares: int = 1, context: bool = True) -> tuple[str, int]:
    """The device of `devices` (a device group) with the least room for this worker (`device_room`), and its
    bytes."""
    room, device = min((device_room(group, device, shares, context), device) for device in devices)
    return device, room


def checks_memory(options: Placement, device: str) -> bool:
    """Whether a worker on `device` is refused a plan that does not fit: on CUDA, or wherever --device-memory says."""
    return is_gpu(device) or options.device_memory is not None


def refuse_what_does_not_fit(group: GroupPlan, free_bytes: int, beside_vllm: bool = False,
                             device: str = "cuda:0") -> None:
    """A one-line error, before any weights are read, when the grid's largest cell needs more than `free_bytes` on
    `device` (with `beside_vllm`: what is left beside vLLM's share)."""
    hints = [h for h, on in (("--dtype bfloat16", dtype_bytes(group.engine.dtype) > 2),
                             ("--vllm-memory", beside_vllm)) if on]
    memory_fit.refuse_what_does_not_fit(plan_for_device(group, device), free_bytes, device, beside_vllm, hints)


def wait_for_room(group: GroupPlan, devices: tuple[str, ...], shares: int = 1, wait_s: float = 0.0,
                  clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep) -> None:
    """Refuse, before any group forms, a plan that does not fit the group's `devices`; with `wait_s`, first wait up
    to that long for memory to be released (a restarted worker: its dead predecessor's memory may not be yet)."""
    if not checks_memory(group.placement, devices[0]):
        return
    plan, deadline = plan_for_device(group, devices[0]), clock() + wait_s
    device, room = group_room(group, devices, shares)
    while plan is not None and plan.total > room - memory_fit.headroom(room) and clock() < deadline:
        sleep(1.0)
        device, room = group_room(group, devices, shares)
    refuse_what_does_not_fit(group, room, device=device)


def auto_batch(group: GroupPlan, groups: list[tuple[str, ...]], shares: int = 1, context: bool = True) -> int:
    """`--batch auto`: the most problems in flight whose plan fits every device group's devices (`groups`) with
    headroom; a one-line error when one problem does not fit. `context=False`: from the devices' total memory
    (`device_room`)."""
    device, free = min((group_room(group, devices, shares, context) for devices in groups), key=lambda found: found[1])
    kind, plans = device_kind(group, device), group.cells
    models = planner.grid_models(group.native_models())
    room = free - memory_fit.headroom(free)
    batch = memory_fit.largest_batch(lambda b: planner.plan_grid(plans, models, kind, b), room)
    if batch is None:
        memory_fit.refuse_what_does_not_fit(planner.plan_grid(plans, models, kind, 1), free, device)
    return batch


def batch_description(group: GroupPlan) -> dict:
    """The batch --batch auto chose, for config.json's executor (nothing for a batch given as a number)."""
    return {"batch": group.settings.batch, "batch_auto": True} if group.engine.batch_auto else {}


def vllm_specs(group: GroupPlan) -> list[EngineSpec]:
    """The vLLM engines the grid starts (`vllm_engine.roles.engine_specs` of its vLLM roles)."""
    return engine_specs(group.vllm_models(), group.settings.context_cap)


def vllm_memory(group: GroupPlan, device: str, free: int, total: int) -> list[dict]:
    """Each vLLM engine's share of the device (`vllm_engine.shares.engine_shares`: one-line errors for a share that
    does not fit); on a GPU this engine's models and caches must fit in the rest. `free`, `total`: the device's
    bytes (`device_memory`)."""
    specs, engine = vllm_specs(group), group.engine
    if not specs:
        return []
    shares = engine_shares(specs, engine.vllm_memory, dtype_bytes(engine.dtype), device, free, total)
    if is_gpu(device):
        refuse_what_does_not_fit(group, int(free - engine.vllm_memory * total), beside_vllm=True, device=device)
    return shares
