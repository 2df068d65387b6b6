"""Device names as `--devices` gives them (`cpu`, `cuda` = `cuda:0`, `cuda:N`), their --tp groups and how many workers
share each: what every layer asks of them.

No torch at import: the CLI, the grid and the worker pool read device names before any model is loaded (resolving
`auto` asks torch for the visible GPUs, and `--ray-address` the cluster for its own).
"""

from __future__ import annotations

from kvrescue.errors import InputError

CPU = "cpu"
GPU = "cuda"  # a GPU of any index: what a Ray worker asks for
RAY_QUIET = dict(include_dashboard=False, log_to_driver=False, logging_level="warning")  # joining or starting Ray


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


def resolve_devices(spec: str, ray_address: str | None = None, visible: bool = True) -> tuple[str, ...]:
    """`auto` (every visible GPU, else the CPU), `cpu`, `cuda` (= cuda:0), or a comma list (`cuda:0,cuda:1`,
    `cpu,cpu`). With `ray_address` (joined here) `auto` is every GPU of the cluster and each entry asks Ray
    for one device of its kind, `cuda` (any GPU) or `cpu`, on whichever node has one free. `visible=False`
    (`run --plan`): the devices named, whether or not this machine has them."""
    import torch

    if not visible and spec != "auto":
        return device_list(spec)
    if ray_address is not None:
        return _cluster_devices(spec, ray_address)
    if spec == "auto":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        return tuple(f"cuda:{i}" for i in range(count)) or ("cpu",)
    devices = device_list(spec)
    for device in devices:
        if is_gpu(device) and gpu_index(device) >= (torch.cuda.device_count() if torch.cuda.is_available() else 0):
            raise InputError(f"--devices {spec!r}: {device} is not a visible GPU")
    return devices


def _cluster_devices(spec: str, address: str) -> tuple[str, ...]:
    import ray

    try:
        ray.init(address=address, **RAY_QUIET)
    except (ConnectionError, RuntimeError, ValueError) as err:
        raise InputError(f"--ray-address {address}: cannot join the Ray cluster ({err})") from None
    gpus = int(ray.cluster_resources().get("GPU", 0))
    if spec == "auto":
        if not gpus:
            raise InputError(f"--ray-address {address}: the cluster offers no GPU; name CPU workers with "
                             "--devices cpu,cpu,...")
        return (GPU,) * gpus
    devices = tuple(kind_of(d) for d in device_list(spec))
    if devices.count(GPU) > gpus:
        raise InputError(f"--devices {spec!r}: the cluster at {address} offers {gpus} GPUs")
    return devices


def device_groups(devices: tuple[str, ...], size: int = 1) -> list[tuple[str, ...]]:
    """The devices in consecutive groups of `size` (--tp's K): one worker per group; a one-line error when `size`
    does not divide them."""
    if len(devices) % size:
        raise InputError(f"--tp {size} does not divide the {len(devices)} devices of --devices {','.join(devices)} "
                         f"({len(devices)} devices do not split into groups of {size}): each group is one worker")
    return [devices[i:i + size] for i in range(0, len(devices), size)]


def device_shares(groups: list[tuple[str, ...]], group: int) -> int:
    """How many workers share the devices of `groups[group]`: a local GPU named by several groups
    (`cuda:0,cuda:0`) is shared, and each worker plans its memory for its share of it."""
    devices = groups[group]
    if gpu_index(devices[0]) is None:
        return 1
    return max(sum(d == device for g in groups for d in g) for device in devices)
