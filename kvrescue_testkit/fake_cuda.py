"""A CUDA device emulated on the CPU with PyTorch's fake tensors, for dry runs of the engine's CUDA path.

Inside `FakeCuda()` every tensor on a `cuda` device is a `FakeTensor`: it has a device, dtype, shape and strides but
no data, and each operation runs PyTorch's meta kernel for it. So a tensor on the wrong device (a CPU tensor mixed
into a CUDA computation), a wrong dtype or an impossible view raises as it would on a GPU, at the real shapes (7B
weights cost no memory). What fake tensors cannot do by themselves on a CPU-only build, and what this module adds:

- Python indexing (`x[i]`, `x[i] = y`), `copy_` and `contiguous` take a device guard for the tensor's device in
  their Python bindings, which a build without CUDA cannot give ("not linked with support for cuda devices"): while
  such a call runs, the device query the guard makes is answered with the CPU (a no-op guard); the operation itself
  is PyTorch's.
- SDPA's kernel choice: on a CPU-only build the fused CUDA kernels cannot be chosen, so `scaled_dot_product_attention`
  would decompose into the math path (contiguous outputs). Here it picks as CUDA does on sm80+ (flash-attention
  without a mask in half precision, else memory-efficient attention, `cuda/sdp_utils.cpp`) and calls that kernel,
  whose meta function gives its CUDA output layout (memory-efficient: [B, M, H, K] memory returned transposed).
- Host reads (`.numpy()`, `.tolist()`, `.item()` of a fake tensor) have no values: a `HostReads` policy gives them
  (zeros by default; a dry run scripts its tokens).
- `torch.cuda` calls (memory queries, streams, events, CUDA graphs, `set_device` with PyTorch's validation, `device_count`; not `is_available`, which
  the fake mode reads to know that it must not run CUDA kernels for constants) are stand-ins: memory is what the fake
  tensors hold; a graph capture runs its body once and a replay computes nothing (stream order counts it as one
  kernel), and a host read, synchronisation or pinned copy during a capture raises, as `cudaStreamCapture` refuses
  them.
- Stream order (`stream_order`): streams, events and host waits as vector clocks, every operation a kernel on the
  current stream; a read or write of a storage that another stream wrote or read without a wait in between raises
  `StreamRace`, as PyTorch's CUDA Sanitizer does on a GPU.
- `Tensor.pin_memory` has no fake kernel: it checks that the tensor is on the CPU and returns a fake copy.

`MemoryLog` counts the bytes of every storage alive, per device and per part (the engine module that allocated it,
or a label), and their peaks, so a memory planner's figures can be compared with what the code allocates.
"""

from __future__ import annotations

import sys
import weakref
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.cuda._utils import _get_device_index
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from kvrescue_testkit.stream_order import FakeEvent, StreamOrder, accesses

aten = torch.ops.aten
GiB = 2**30
# Tensor methods whose Python bindings take a device guard for the tensor's device (python_variable_indexing.cpp,
# python_variable_methods.cpp), which a CPU-only build cannot give for CUDA
GUARDED = {torch.Tensor.__getitem__, torch.Tensor.__setitem__, torch.Tensor.copy_, torch.Tensor.contiguous}
FLASH_DTYPES = (torch.float16, torch.bfloat16)


class CaptureError(RuntimeError):
    """An operation a CUDA graph capture refuses (a host read, a synchronisation, a pinned host copy)."""


class HostReads:
    """Values for host reads of fake tensors: zeros of the tensor's shape and dtype (override `values`)."""

    def values(self, tensor: torch.Tensor) -> np.ndarray:
        return np.zeros(tuple(tensor.shape), dtype=numpy_dtype(tensor.dtype))


def numpy_dtype(dtype: torch.dtype) -> np.dtype:
    """The numpy dtype a host copy of a `dtype` tensor has (bfloat16, which numpy lacks: float32)."""
    return np.dtype({torch.bfloat16: np.float32, torch.bool: np.bool_}.get(dtype) or str(dtype).removeprefix("torch."))


@dataclass
class MemoryLog:
    """Bytes of the storages alive, per device and per part, and their peaks (`peak` per device, with the parts
    alive at that moment in `at_peak`; `part_peaks` each part's own peak)."""

    live: Counter = field(default_factory=Counter)  # (device, part) -> bytes
    device_live: Counter = field(default_factory=Counter)
    peak: Counter = field(default_factory=Counter)  # device -> bytes
    at_peak: dict[str, dict[str, int]] = field(default_factory=dict)
    part_peaks: Counter = field(default_factory=Counter)  # (device, part) -> bytes
    label: str | None = None
    storages: dict[int, tuple[str, str, int]] = field(default_factory=dict)

    def allocated(self, tensor: torch.Tensor) -> None:
        """Count `tensor`'s storage if it is new, until it is freed."""
        storage = tensor.untyped_storage()
        key = storage._cdata
        if key in self.storages:
            return
        device, part, nbytes = str(tensor.device), self.label or _allocating_part(), storage.nbytes()
        self.storages[key] = (device, part, nbytes)
        weakref.finalize(storage, self._freed, key)
        self.live[device, part] += nbytes
        self.device_live[device] += nbytes
        self.part_peaks[device, part] = max(self.part_peaks[device, part], self.live[device, part])
        if self.device_live[device] > self.peak[device]:
            self.peak[device] = self.device_live[device]
            self.at_peak[device] = {p: b for (d, p), b in self.live.items() if d == device and b}

    def _freed(self, key: int) -> None:
        device, part, nbytes = self.storages.pop(key)
        self.live[device, part] -= nbytes
        self.device_live[device] -= nbytes

    def reset_peaks(self) -> None:
        """Start the peaks from what is alive now."""
        self.peak = Counter(self.device_live)
        self.at_peak = {d: {p: b for (dd, p), b in self.live.items() if dd == d and b} for d in self.device_live}
        self.part_peaks = Counter(self.live)

    @contextmanager
    def labelled(self, label: str) -> Iterator[None]:
        """Storages allocated in the block count under `label` instead of their module."""
        previous, self.label = self.label, label
        try:
            yield
        finally:
            self.label = previous


def _allocating_part() -> str:
    """The innermost kvrescue module on the stack (e.g. `engine.bounded`), which names what a storage is for."""
    frame = sys._getframe(2)
    while frame is not None:
        name = frame.f_globals.get("__name__", "")
        if name.startswith("kvrescue.") and name != __name__:
            return name.removeprefix("kvrescue.")
        frame = frame.f_back
    return "other"


class _Dispatch(TorchDispatchMode):
    """Above the fake mode: counts new storages, answers the indexing guard's device query, counts copies to the
    host and refuses them (and scalar reads) during a capture."""

    def __init__(self, cuda: FakeCuda) -> None:
        super().__init__()
        self.cuda = cuda

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.prim.device.default and self.cuda.guarded:
            return torch.device("cpu")
        if self.cuda.capturing and func is aten._local_scalar_dense.default:
            raise CaptureError("a host read (.item(), bool(tensor)) during a CUDA graph capture")
        if func is aten._to_copy.default and args[0].device.type == "cuda" and \
                torch.device(kwargs.get("device") or args[0].device).type == "cpu":
            if self.cuda.capturing:
                raise CaptureError("a copy to the host (.cpu()) during a CUDA graph capture")
            self.cuda.syncs += not kwargs.get("non_blocking")  # a non-blocking copy: the wait is its event's
        out = func(*args, **kwargs)
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.cuda.memory.allocated(t)
        if func.namespace == "aten" and func is not aten.record_stream.default:
            self._order(func, args, kwargs, out)
        return out

    def _order(self, func, args, kwargs, out) -> None:
        """The operation as a kernel on the current stream (`stream_order`); copies to the host and host reads as
        such; an operation on CPU tensors alone, a host read of them."""
        order, name = self.cuda.order, str(func)
        reads, writes, made = accesses(func, args, kwargs, out)
        on_device = [t for t in reads + writes + made if t.device.type == "cuda"]
        if not on_device:
            for t in reads + writes:
                order.host_read(name, t)
        elif func is aten._local_scalar_dense.default:
            order.host_reads_device(name, args[0])
        elif func in (aten._to_copy.default, aten.copy_.default) and \
                (writes[0].device.type, on_device[0].device.type) == ("cpu", "cuda"):
            non_blocking = kwargs.get("non_blocking") or (func is aten.copy_.default and len(args) > 2 and args[2])
            order.copied_to_host(name, on_device[0], writes[0], bool(non_blocking))
        else:
            order.launch(name, *([t for t in ts if t.device.type == "cuda"] for ts in (reads, writes, made)))


class _Functions(TorchFunctionMode):
    """Marks the calls of `GUARDED` bindings for `_Dispatch`, and sends SDPA on CUDA tensors to the kernel CUDA would pick."""

    def __init__(self, cuda: FakeCuda) -> None:
        super().__init__()
        self.cuda = cuda

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in GUARDED:
            self.cuda.guarded += 1
            try:
                return func(*args, **kwargs)
            finally:
                self.cuda.guarded -= 1
        if func is F.scaled_dot_product_attention and args[0].device.type == "cuda":
            return cuda_sdpa(*args, **kwargs)
        return func(*args, **kwargs)


def sdpa_backend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: torch.Tensor | None,
                 dropout_p: float, is_causal: bool, enable_gqa: bool) -> str:
    """The kernel CUDA's SDPA picks on sm80+ without cuDNN preferred (`cuda/sdp_utils.cpp`, priority flash, then
    memory-efficient, then math): "flash", "efficient" or "math"."""
    dense = all(t.stride(-1) == 1 or t.shape[-1] == 1 for t in (q, k, v))
    heads_ok = q.shape[1] == k.shape[1] or (enable_gqa and q.shape[1] % k.shape[1] == 0)
    same_dim = q.shape[-1] == k.shape[-1] == v.shape[-1]
    if (attn_mask is None and q.dtype in FLASH_DTYPES and same_dim and q.shape[-1] <= 256 and dense and heads_ok
            and not (is_causal and q.shape[2] != k.shape[2])):
        return "flash"
    alignment = 8 if q.dtype in FLASH_DTYPES else 4
    if q.shape[-1] % alignment == 0 and v.shape[-1] % alignment == 0 and heads_ok and q.stride(-1) == 1 \
            and k.stride(-1) == 1 and v.stride(-1) == 1 and q.dtype in (*FLASH_DTYPES, torch.float32):
        return "efficient"
    return "math"


def cuda_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: torch.Tensor | None = None,
              dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None,
              enable_gqa: bool = False) -> torch.Tensor:
    """`F.scaled_dot_product_attention` as on CUDA: the kernel `sdpa_backend` picks, with that kernel's output layout."""
    backend = sdpa_backend(q, k, v, attn_mask, dropout_p, is_causal, enable_gqa)
    if backend == "flash":
        return aten._scaled_dot_product_flash_attention(q, k, v, dropout_p, is_causal, scale=scale)[0]
    if backend == "efficient":
        bias = attn_mask
        if bias is not None and bias.dtype == torch.bool:
            bias = torch.zeros(bias.shape, dtype=q.dtype, device=q.device).masked_fill_(bias.logical_not(), float("-inf"))
        return aten._scaled_dot_product_efficient_attention(q, k, v, bias, False, dropout_p, is_causal, scale=scale)[0]
    with torch._C.DisableTorchFunction():
        return F.scaled_dot_product_attention(q, k, v, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa)


class _Event(FakeEvent):
    """torch.cuda.Event's stand-in (`stream_order`): waiting for it is a synchronisation, refused during a capture."""

    def __init__(self, cuda: FakeCuda) -> None:
        super().__init__(cuda.order)
        self.cuda = cuda

    def synchronize(self) -> None:
        if self.cuda.capturing:
            raise CaptureError("an event waited for during a CUDA graph capture")
        self.cuda.syncs += 1
        super().synchronize()


class _Graph:
    """torch.cuda.CUDAGraph's stand-in: `torch.cuda.graph` runs the capture's body once, recording the storages its
    kernels read and write; a replay is one kernel over them on the current stream (fake tensors have no values to
    recompute)."""

    def __init__(self, cuda: FakeCuda) -> None:
        self.cuda = cuda
        self.captured = False
        self.accesses: list = []

    def replay(self) -> None:
        if not self.captured:
            raise RuntimeError("CUDAGraph.replay before a capture")
        self.cuda.graph_replays += 1
        self.cuda.order.replay(self.accesses)


class FakeCuda:
    """The fake CUDA devices `cuda:0 .. cuda:{devices - 1}` of `memory_gib` GiB each, for the `with` block."""

    def __init__(self, devices: int = 1, memory_gib: float = 139.8, host_reads: HostReads | None = None,
                 name: str = "fake NVIDIA H200") -> None:
        self.devices, self.total, self.name = devices, int(memory_gib * GiB), name
        self.host_reads = host_reads or HostReads()
        self.memory = MemoryLog()
        self.guarded = 0  # depth of calls into a `GUARDED` binding
        self.capturing = False
        self.current = 0
        self.syncs = 0  # host reads of CUDA tensors and synchronisations
        self.graph_replays = 0
        self.order = StreamOrder(self._describe)
        self._stack: ExitStack | None = None
        self.mode: FakeTensorMode | None = None

    def __enter__(self) -> FakeCuda:
        stack = ExitStack()
        try:
            for target, name, value in self._patches():
                stack.enter_context(_patched(target, name, value))
            self.mode = stack.enter_context(FakeTensorMode(allow_non_fake_inputs=True))
            stack.enter_context(_Dispatch(self))
            stack.enter_context(_Functions(self))
        except BaseException:
            stack.close()
            raise
        self._stack = stack
        return self

    def __exit__(self, *exc: Any) -> None:
        stack, self._stack = self._stack, None
        stack.close()
        if exc[0] is None:
            self.order.check()

    # -- stand-ins ------------------------------------------------------------------------------------
    def _patches(self) -> list[tuple[Any, str, Any]]:
        cuda = torch.cuda
        return [
            (cuda, "device_count", lambda: self.devices),
            (cuda, "current_device", lambda: self.current),
            (cuda, "set_device", self._set_device),
            (cuda, "get_device_name", lambda device=None: self.name),
            (cuda, "mem_get_info", self._mem_get_info),
            (cuda, "memory_allocated", lambda device=None: self.memory.device_live[self._name(device)]),
            (cuda, "max_memory_allocated", lambda device=None: self.memory.peak[self._name(device)]),
            (cuda, "empty_cache", lambda: None),
            (cuda, "synchronize", self._synchronize),
            (cuda, "Stream", self.order.new_stream),
            (cuda, "Event", lambda *args, **kwargs: _Event(self)),
            (cuda, "current_stream", lambda device=None: self.order.current),
            (cuda, "default_stream", lambda device=None: self.order.default),
            (cuda, "stream", self.order.on),
            (torch.Tensor, "record_stream", lambda tensor, stream: self.order.record_stream(tensor, stream)),
            (cuda, "graph_pool_handle", lambda: object()),
            (cuda, "CUDAGraph", lambda: _Graph(self)),
            (cuda, "graph", self._graph),
            (FakeTensor, "numpy", self._read("numpy", lambda t: self.host_reads.values(t), host_only=True)),
            (FakeTensor, "tolist", self._read("tolist", lambda t: self.host_reads.values(t).tolist())),
            (FakeTensor, "item", self._read("item", lambda t: self.host_reads.values(t).item())),
            (torch.Tensor, "pin_memory", lambda tensor, *args: self._pin_memory(tensor)),
            (torch.utils, "swap_tensors", _swap_unless_same(torch.utils.swap_tensors)),
        ]

    def _describe(self, tensor: torch.Tensor) -> str:
        """A storage as a race names it: its device, bytes and the part that allocated it (`MemoryLog`)."""
        device, part, nbytes = self.memory.storages.get(tensor.untyped_storage()._cdata,
                                                        (str(tensor.device), "?", tensor.untyped_storage().nbytes()))
        return f"a {device} storage of {nbytes:,} bytes ({part}, {str(tensor.dtype).removeprefix('torch.')})"

    def _name(self, device: Any = None) -> str:
        index = device if isinstance(device, int) or device is None else torch.device(device).index
        return f"cuda:{self.current if index is None else index}"

    def _set_device(self, device: Any) -> None:
        index = _get_device_index(device)  # PyTorch's own check: `cuda` without an index is refused, as on a GPU
        if index < 0:
            return
        if index >= self.devices:
            raise RuntimeError(f"CUDA error: invalid device ordinal {index} ({self.devices} fake devices)")
        self.current = index

    def _mem_get_info(self, device: Any = None) -> tuple[int, int]:
        return self.total - self.memory.device_live[self._name(device)], self.total

    def _synchronize(self, device: Any = None) -> None:
        if self.capturing:
            raise CaptureError("torch.cuda.synchronize during a CUDA graph capture")
        self.syncs += 1
        self.order.synchronize()

    @contextmanager
    def _graph(self, graph: _Graph, pool: Any = None, stream: Any = None, **kwargs: Any) -> Iterator[None]:
        """As `torch.cuda.graph`: the device synchronised (not counted in `syncs`: no host read), then the body on
        the capture stream (`stream`, or a side stream of its own), its kernels recorded for the replays."""
        if self.capturing:
            raise CaptureError("a CUDA graph capture inside another")
        self.order.synchronize()
        self.capturing, self.order.captured = True, []
        try:
            with self.order.on(stream or self.order.new_stream()):
                yield
        finally:
            self.capturing, graph.accesses, self.order.captured = False, self.order.captured, None
        graph.captured = True

    def _read(self, name: str, value: Callable[[torch.Tensor], Any], host_only: bool = False) -> Callable[..., Any]:
        """A host read of a fake tensor (`host_only`: of a CPU one only, as `.numpy()`); each read of a CUDA tensor
        is a synchronisation, counted in `syncs`."""
        def read(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            if self.capturing:
                raise CaptureError(f"Tensor.{name} (a host read) during a CUDA graph capture")
            if tensor.device.type == "cuda":
                if host_only:
                    raise TypeError(f"can't convert {tensor.device} device type tensor to numpy: copy it to the host first")
                self.syncs += 1
                self.order.host_reads_device(f"Tensor.{name}", tensor)
            else:
                self.order.host_read(f"Tensor.{name}", tensor)
            return value(tensor)
        return read

    def _pin_memory(self, tensor: torch.Tensor) -> torch.Tensor:
        if tensor.device.type != "cpu":
            raise RuntimeError(f"cannot pin a tensor on {tensor.device}: only dense CPU tensors can be pinned")
        if self.capturing:
            raise CaptureError("a pinned host copy during a CUDA graph capture")
        return torch.empty(tensor.shape, dtype=tensor.dtype)  # a new tensor, as pinning makes; not a constant (a copy of
        # a one-element constant to CUDA would run the real CUDA kernel)


def _swap_unless_same(swap: Callable[[torch.Tensor, torch.Tensor], None]) -> Callable[[torch.Tensor, torch.Tensor], None]:
    """`Module.to` swaps every fake parameter with its converted copy, which `swap_tensors` refuses for a tensor
    with a weak reference (the fake mode's memo holds one): a conversion that changed nothing (the parameter
    wrapped again, same storage, dtype, shape and strides) is skipped; any other goes to `swap`."""
    def swap_tensors(t1: torch.Tensor, t2: torch.Tensor) -> None:
        if isinstance(t1, FakeTensor) and isinstance(t2, FakeTensor) and t1.device == t2.device \
                and t1.dtype == t2.dtype and t1.shape == t2.shape and t1.stride() == t2.stride() \
                and t1.untyped_storage()._cdata == t2.untyped_storage()._cdata:
            return
        swap(t1, t2)
    return swap_tensors


@contextmanager
def _patched(target: Any, name: str, value: Any) -> Iterator[None]:
    had = name in vars(target)
    previous = vars(target).get(name)
    setattr(target, name, value)
    try:
        yield
    finally:
        if had:
            setattr(target, name, previous)
        else:
            delattr(target, name)


def peaks(memory: MemoryLog) -> dict[str, dict[str, Any]]:
    """Per device: the peak bytes and the bytes of each part alive at that moment, and each part's own peak."""
    report: dict[str, dict[str, Any]] = defaultdict(dict)
    for device, peak in memory.peak.items():
        if not peak:  # e.g. "meta": the seeds of the attention kernels' meta functions
            continue
        report[device] = {"peak_bytes": peak, "at_peak": dict(sorted(memory.at_peak.get(device, {}).items())),
                          "part_peaks": {p: b for (d, p), b in sorted(memory.part_peaks.items()) if d == device and b}}
    return dict(report)
