"""Host to device transfers that never wait for the device.

The host already knows every row's metadata (lengths, slots, block tables): it computes a forward's index
arrays with numpy and sends them in one copy, through pinned memory on CUDA, so queued device work is not
drained first (a plain `torch.tensor(..., device="cuda")` from pageable memory waits for it).
"""

from __future__ import annotations

import numpy as np
import torch


def upload(host: torch.Tensor | np.ndarray, device: torch.device) -> torch.Tensor:
    """A small host tensor on `device` without waiting for the device: on CUDA it is copied through pinned
    memory (the caching host allocator keeps that block until the copy is done), so the host may go on."""
    if isinstance(host, np.ndarray):
        host = torch.from_numpy(np.ascontiguousarray(host))
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def upload_into(target: torch.Tensor, host: np.ndarray) -> None:
    """`host` copied into the device tensor `target` (same shape) without waiting for the device, as `upload` does,
    and with no device tensor in between (a static buffer refilled before a CUDA graph's replay)."""
    source = torch.from_numpy(np.ascontiguousarray(host))
    target.copy_(source.pin_memory() if target.device.type == "cuda" else source, non_blocking=True)


def upload_all(arrays: dict[str, np.ndarray], device: torch.device) -> dict[str, torch.Tensor]:
    """Integer or boolean host arrays on `device` in one copy: views of one int64 buffer, each with its shape
    (booleans become bool tensors)."""
    flat = [np.asarray(a).astype(np.int64, copy=False).ravel() for a in arrays.values()]
    buffer = upload(np.concatenate(flat) if flat else np.zeros(0, np.int64), device)
    out = {}
    for (name, array), part in zip(arrays.items(), buffer.split_with_sizes([len(p) for p in flat])):
        view = part.view(np.shape(array))
        out[name] = view.bool() if np.asarray(array).dtype == bool else view
    return out


class Download:
    """A device tensor's copy to the host, started now and read later (`wait`), so that the host can launch other
    work first: on CUDA a non-blocking copy into pinned memory and an event after it (`wait` waits for that event
    alone, not for what was queued later), elsewhere a plain copy when it is read."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.event = None
        if tensor.device.type == "cuda":
            self.host = tensor.to("cpu", non_blocking=True)  # into pinned memory, as a non-blocking copy to the host is
            self.event = torch.cuda.Event()
            self.event.record()
        else:
            self.host = tensor

    def wait(self) -> np.ndarray:
        """The values, once the copy is done (a synchronisation with the device, up to the copy)."""
        if self.event is None:
            return self.host.cpu().numpy()
        self.event.synchronize()
        return self.host.numpy()
