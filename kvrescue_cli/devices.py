"""Device names as `--devices` gives them (`cpu`, `cuda` = `cuda:0`, `cuda:N`): what every layer asks of one.

No torch here: the CLI, the grid and the worker pool read device names before any model is loaded.
"""

from __future__ import annotations

from kvrescue_cli.errors import InputError

CPU = "cpu"
GPU = "cuda"  # a GPU of any index: what a Ray worker asks for


def is_gpu(device: str) -> bool:
    """Whether `device` (`cuda`, `cuda:N`) is a GPU."""
    return device.startswith(GPU)


def is_cpu(device: str) -> bool:
    return device == CPU


def gpu_index(device: str) -> int | None:
    """N of `cuda:N`; None for the CPU and for `cuda` without an index."""
    return int(device[len(GPU) + 1:]) if device.startswith(GPU + ":") else None


def kind_of(device: str) -> str:
    """`cpu` or `cuda`: the device's kind, whichever GPU it is."""
    return GPU if is_gpu(device) else CPU


def device_list(spec: str) -> tuple[str, ...]:
    """A comma list of devices (`cuda:0,cuda:1`, `cpu,cpu`), `cuda` read as `cuda:0`; InputError for another name."""
    devices = tuple(f"{GPU}:0" if d == GPU else d for d in (part.strip() for part in spec.split(",")) if d)
    for device in devices:
        if not is_cpu(device) and not (device.startswith(GPU + ":") and device[len(GPU) + 1:].isdigit()):
            raise InputError(f"--devices {spec!r}: {device!r} is not cpu, cuda or cuda:N")
    if not devices:
        raise InputError("--devices is empty")
    return devices
