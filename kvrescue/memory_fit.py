"""A device's memory against a plan (`memory_plan.DevicePlan`): the headroom a plan leaves free, the largest batch
that fits (`--batch auto`), and the one-line refusal of a plan that does not. No torch here."""

from __future__ import annotations

from typing import Callable, Iterable

from kvrescue.errors import InputError
from kvrescue.memory_plan import DevicePlan

GIB = 2**30
HEADROOM_SHARE, HEADROOM_MIN = 0.05, GIB  # of a device's free memory kept free: 5%, at least 1 GiB
MAX_BATCH = 4096  # the largest batch `--batch auto` considers


def headroom(free: int) -> int:
    """Bytes of a device's free memory a plan leaves unused."""
    return max(HEADROOM_MIN, int(HEADROOM_SHARE * free))


def largest_batch(plan: Callable[[int], DevicePlan], room: int) -> int | None:
    """The largest batch (up to MAX_BATCH) whose plan fits in `room` bytes, or None when one problem does not."""
    if plan(1).total > room:
        return None
    low, high = 1, MAX_BATCH
    while low < high:
        mid = (low + high + 1) // 2
        low, high = (mid, high) if plan(mid).total <= room else (low, mid - 1)
    return low


def gib(n: int) -> str:
    return f"{n / GIB:.1f} GiB"


def summary(plan: DevicePlan) -> str:
    """One line: each role's weights + KV + buffers + activation peak."""
    parts = [f"{role} {gib(plan.bytes(role, 'weights'))} + KV {gib(plan.bytes(role, 'kv'))} + buffers "
             f"{gib(plan.bytes(role, 'buffers'))}" for role in plan.roles]
    peak = plan.peak_moment
    return ", ".join(parts) + f", activations {gib(peak.bytes)} at the {peak.role} {peak.what}"


def refuse_what_does_not_fit(plan: DevicePlan | None, free: int, device: str, beside_vllm: bool = False,
                             hints: Iterable[str] = ()) -> None:
    """A one-line error when `plan` needs more than `free` bytes less the headroom."""
    if plan is None:
        return
    room = free - headroom(free)
    if plan.total > room:
        left = "left beside vLLM's share" if beside_vllm else "free"
        raise InputError(f"batch {plan.batch} needs {gib(plan.total)} on {device} ({summary(plan)}) but "
                         f"{gib(free)} is {left} ({gib(room)} after {gib(headroom(free))} of headroom); "
                         f"{'lower --batch (or --batch auto) or ' if plan.batch > 1 else 'lower '}"
                         f"--n{''.join(', ' + h for h in hints)}, "
                         "or use larger devices")
