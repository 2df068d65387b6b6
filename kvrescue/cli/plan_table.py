"""`kvrescue run --plan` and `--batch auto`: each device's memory plan as a table, and the batch that fits."""

from __future__ import annotations

from typing import TYPE_CHECKING

from rich.markup import escape
from rich.table import Table

from kvrescue.cli.shared import console
from kvrescue.errors import InputError

if TYPE_CHECKING:  # the grid imports torch, which `kvrescue run --help` does without
    from kvrescue.grid import GridOptions


def sized_batch(options: GridOptions, auto: bool) -> GridOptions:
    """The options with --batch auto resolved (printed); others as they are. Configs only: no weights are read."""
    from dataclasses import replace

    from kvrescue import device_plan
    from kvrescue.devices import device_shares

    options.check()
    if not auto:
        return options
    if options.ray_address is not None and options.device_memory is None:
        raise InputError("--batch auto on a Ray cluster needs --device-memory (this process does not see the "
                         "workers' GPUs), or give --batch N")
    groups = options.groups()
    shares = max(device_shares(groups, g) for g in range(len(groups)))
    # Workers in other processes (Ray): plan from the GPUs' total memory, without a CUDA context here; each worker's
    # own check then refuses what its device's free memory cannot hold.
    batch = device_plan.auto_batch(options.group_plan(), groups, shares, context=len(groups) == 1)
    console.print(f"--batch auto: {batch} problems in flight per worker (the most whose memory plan fits)",
                  highlight=False)
    return replace(options, settings=replace(options.settings, batch=batch), batch_auto=True)


def print_plan(options: GridOptions) -> bool:
    """`run --plan`: each device's weights, KV, buffers and activation peak for the grid's largest cell, the device
    each rank computes on, and whether it fits (its free memory, or --device-memory, less the headroom)."""
    from rich import box

    from kvrescue import device_plan, memory_fit
    from kvrescue.devices import device_shares

    groups, grid = options.groups(), options.group_plan()
    table = Table(title=f"kvrescue run --plan: batch {options.settings.batch}"
                  + (" (auto)" if options.batch_auto else "") + f", --tp {options.tp}", box=box.SIMPLE_HEAD)
    for column in ("device\n(worker,\nrank)", "role", "weights", "KV", "buffers", "activ.\npeak", "total"):
        # at 80 columns the numbers stay whole and the device wraps; each device's memory on a line of its own
        table.add_column(column, justify="left" if column in ("device\n(worker,\nrank)", "role") else "right",
                         no_wrap=column != "device\n(worker,\nrank)")
    fits, notes, rooms = True, [], []
    for g, group in enumerate(groups):
        shares = device_shares(groups, g)
        for rank, device in enumerate(group):  # rank r of a group computes on its r-th device
            plan = device_plan.plan_for_device(grid, device)
            if plan is None:
                raise InputError("--plan: a model has no readable config.json")
            room = device_plan.device_room(grid, device, shares)
            usable = room - memory_fit.headroom(room)
            for i, role in enumerate(plan.roles):
                table.add_row(f"{device} ({g}, {rank})" if i == 0 else "", role,
                              *(memory_fit.gib(plan.bytes(role, kind)) for kind in
                                ("weights", "kv", "buffers", "activations")), "")
            ok = plan.total <= usable
            fits &= ok
            table.add_row("", "[bold]all[/]", "", "", "", memory_fit.gib(plan.peak_moment.bytes),
                          memory_fit.gib(plan.total), end_section=True)
            rooms.append(f"{device} ({g}, {rank}): {memory_fit.gib(plan.total)} of {memory_fit.gib(usable)} usable "
                         + ("[green]fits[/]" if ok else "[red]does not fit[/]"))
            if not ok:
                notes.append(f"{device}: needs {memory_fit.gib(plan.total)} but {memory_fit.gib(usable)} is usable "
                             f"({memory_fit.gib(room)} less {memory_fit.gib(memory_fit.headroom(room))} of headroom)"
                             f"; its peak is the {plan.peak_moment.role} {plan.peak_moment.what}")
    console.print(table)
    for line in rooms:
        console.print(line, highlight=False)
    for note in notes:
        console.print(f"[red]does not fit:[/] {escape(note)}", highlight=False, soft_wrap=True)
    return fits
