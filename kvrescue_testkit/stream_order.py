"""Stream order on the fake CUDA device (`fake_cuda`), checked as PyTorch's CUDA Sanitizer (`torch/cuda/_sanitizer.py`,
CSAN) checks it on a GPU, so that a missing wait between streams raises on the CPU.

Every kernel gets a sequence number; every stream holds a vector clock (the last sequence number of each stream it
is ordered after). An event records its stream's clock; `wait_event` and `wait_stream` merge a clock into a
stream's; a host wait (`Event.synchronize`, `Stream.synchronize`, a blocking copy to the host, a scalar read) merges
it into the host's and every stream's, as work launched after it comes after; `torch.cuda.synchronize` orders every
stream after every other. Each storage keeps its last write and the reads since: a kernel that reads a storage
whose last write was on another stream it is not ordered after, or writes one with such a read or write, raises
`StreamRace` naming both operations and streams. Views read nothing (CSAN's "metadata only").

Beyond CSAN:
- the caching allocator: a storage freed while work of a stream other than the one it was allocated on may still
  use it (not ordered before that stream now, and not `record_stream`-ed for it) could be handed out again under
  that work: a race, raised at the next operation (a finaliser cannot raise);
- the host: a CPU tensor written by a non-blocking copy from the device is read by the host (`.numpy()`, a CPU
  operation) only after a host wait covering that copy;
- CUDA graphs: a capture records the storages its kernels read and write without running them; a replay is one
  kernel on the current stream over them.
"""

from __future__ import annotations

import re
import weakref
from collections import Counter
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._pytree import tree_leaves


class StreamRace(RuntimeError):
    """Two accesses to one storage on different streams with no happens-before between them."""


class FakeStream:
    """torch.cuda.Stream's stand-in: a vector clock, starting from what the host has waited for (CSAN's)."""

    def __init__(self, order: StreamOrder, name: str, device: Any = None) -> None:
        self.order, self.name, self.id, self.device = order, name, len(order.streams), device
        self.clock: dict[int, int] = dict(order.host)
        order.streams.append(self)

    def wait_stream(self, stream: FakeStream) -> None:
        _merge(self.clock, stream.clock)

    def wait_event(self, event: FakeEvent) -> None:
        _merge(self.clock, event.clock)

    def record_event(self, event: FakeEvent | None = None) -> FakeEvent:
        event = event or FakeEvent(self.order)
        event.record(self)
        return event

    def synchronize(self) -> None:
        self.order.host_waits(self.clock)

    def query(self) -> bool:
        return True

    def __repr__(self) -> str:
        return self.name


class FakeEvent:
    """torch.cuda.Event's stand-in: the clock of its stream when recorded."""

    def __init__(self, order: StreamOrder) -> None:
        self.order = order
        self.clock: dict[int, int] = {}

    def record(self, stream: FakeStream | None = None) -> None:
        self.clock = dict((stream or self.order.current).clock)

    def wait(self, stream: FakeStream | None = None) -> None:
        (stream or self.order.current).wait_event(self)

    def synchronize(self) -> None:
        self.order.host_waits(self.clock)

    def query(self) -> bool:
        return True


@dataclass(frozen=True)
class Access:
    stream: FakeStream
    seq: int
    op: str


@dataclass(eq=False)
class StorageState:
    """One storage's stream history: where it was allocated, its last write and the reads since."""

    stream: FakeStream
    what: str
    in_graph_pool: bool = False
    pinned: bool = False  # a host copy's: the caching host allocator keeps it until the copy's event
    write: Access | None = None
    reads: dict[int, Access] = field(default_factory=dict)  # by stream: its last read (later ones order after it)
    recorded: set[int] = field(default_factory=set)  # streams `record_stream` named
    alive: bool = True


def _merge(clock: dict[int, int], other: dict[int, int]) -> None:
    for stream, seq in other.items():
        if clock.get(stream, 0) < seq:
            clock[stream] = seq


class StreamOrder:
    """The streams, events and storage histories of one fake CUDA session; `describe(tensor)` names a storage."""

    def __init__(self, describe) -> None:
        self.describe = describe
        self.streams: list[FakeStream] = []
        self.host: dict[int, int] = {}
        self.seq = 0
        self.storages: dict[int, StorageState] = {}
        self.errors: list[str] = []
        self.captured: list[tuple[StorageState, bool]] | None = None  # during a capture: (storage, written)
        self.kernels: Counter[str] = Counter()  # kernels run, by stream name
        self.default = FakeStream(self, "the default stream")
        self.current = self.default

    # -- streams and host waits --------------------------------------------------------------------------
    def new_stream(self, device: Any = None, priority: int = 0) -> FakeStream:
        return FakeStream(self, f"stream {len(self.streams)}", device)

    @contextmanager
    def on(self, stream: FakeStream | None) -> Iterator[None]:
        """`torch.cuda.stream(stream)`: work in the block goes on `stream` (None: where it went)."""
        previous = self.current
        self.current = stream or previous
        try:
            yield
        finally:
            self.current = previous

    def host_waits(self, clock: dict[int, int]) -> None:
        """The host waited for the work `clock` covers: all later work, on any stream, comes after it."""
        _merge(self.host, clock)
        for stream in self.streams:
            _merge(stream.clock, clock)

    def synchronize(self) -> None:
        """`torch.cuda.synchronize`: every stream's work done."""
        for stream in self.streams:
            self.host[stream.id] = stream.clock.get(stream.id, 0)
        for stream in self.streams:
            _merge(stream.clock, self.host)

    # -- storages ---------------------------------------------------------------------------------------
    def state(self, tensor: torch.Tensor) -> StorageState:
        storage = tensor.untyped_storage()
        key = storage._cdata
        state = self.storages.get(key)
        if state is None:
            state = self.storages[key] = StorageState(self.current, self.describe(tensor), self.captured is not None)
            weakref.finalize(storage, self._freed, key, state)
        return state

    def record_stream(self, tensor: torch.Tensor, stream: FakeStream) -> None:
        """`Tensor.record_stream`: the allocator keeps the storage until `stream`'s work queued so far is done."""
        self.state(tensor).recorded.add(stream.id)

    def _freed(self, key: int, state: StorageState) -> None:
        state.alive = False
        if self.storages.get(key) is state:
            del self.storages[key]
        if state.in_graph_pool or state.pinned:
            return  # a graph's private pool serves that graph alone
        for access in ([state.write] if state.write else []) + list(state.reads.values()):
            if access.stream is not state.stream and access.stream.id not in state.recorded \
                    and not self._ordered(state.stream, access):
                self.errors.append(f"stream race: {state.what}, allocated on {state.stream}, was freed while "
                                   f"{access.op} on {access.stream} may still use it (no wait of {state.stream} for "
                                   f"it, no record_stream): the caching allocator may hand it out again under it")

    # -- kernels ----------------------------------------------------------------------------------------
    def check(self) -> None:
        """Raise the first race found where no exception could be raised (a storage freed)."""
        if self.errors:
            errors, self.errors = self.errors, []
            raise StreamRace(errors[0])

    def launch(self, op: str, reads: Iterable[torch.Tensor], writes: Iterable[torch.Tensor],
               made: Iterable[torch.Tensor] = ()) -> None:
        """A kernel on the current stream reading and writing these CUDA tensors' storages (`made`: allocated by it,
        on the current stream)."""
        self.check()
        for tensor in made:
            self.state(tensor)
        read_states = [self.state(t) for t in reads]
        write_states = [self.state(t) for t in writes]
        if self.captured is not None:  # captured, not run: the replays run it
            self.captured += [(s, False) for s in read_states] + [(s, True) for s in write_states]
            return
        self.run(op, read_states, write_states)

    def run(self, op: str, reads: list[StorageState], writes: list[StorageState]) -> Access:
        self.seq += 1
        stream = self.current
        stream.clock[stream.id] = self.seq
        access = Access(stream, self.seq, op)
        self.kernels[stream.name] += 1
        written = {id(s) for s in writes}
        for state in reads:
            if id(state) not in written:
                self._against(access, state, state.write, "reads", "wrote")
                state.reads[stream.id] = access
        for state in writes:
            for previous in list(state.reads.values()) or [state.write]:
                self._against(access, state, previous, "writes", "read" if state.reads else "wrote")
            state.write, state.reads = access, {}
        return access

    def replay(self, captured: list[tuple[StorageState, bool]]) -> None:
        """A captured graph's kernels, as one kernel on the current stream."""
        self.check()
        live = [(s, w) for s, w in captured if s.alive]
        self.run("CUDAGraph.replay", [s for s, w in live if not w], [s for s, w in live if w])

    def _ordered(self, stream: FakeStream, access: Access) -> bool:
        return access.stream is stream or stream.clock.get(access.stream.id, 0) >= access.seq

    def _against(self, access: Access, state: StorageState, previous: Access | None, verb: str, did: str) -> None:
        if previous is not None and not self._ordered(access.stream, previous):
            raise StreamRace(f"stream race: {access.op} on {access.stream} {verb} {state.what} that {previous.op} "
                             f"{did} on {previous.stream}, with no wait between them")

    # -- the host ---------------------------------------------------------------------------------------
    def copied_to_host(self, op: str, source: torch.Tensor, host: torch.Tensor, non_blocking: bool) -> None:
        """A copy of `source` to the host tensor `host` on the current stream: the host waits for it, unless
        `non_blocking` (then `host` is the stream's until a host wait covers the copy)."""
        self.launch(op, [source], [])
        if self.captured is not None:
            return
        if non_blocking:
            state = self.state(host)
            state.pinned, state.write, state.reads = True, Access(self.current, self.seq, op), {}
        else:
            self.host_waits(self.current.clock)

    def host_read(self, op: str, tensor: torch.Tensor) -> None:
        """The host reads a CPU tensor (an operation on it, `.numpy()`): after the copy that wrote it, if one did."""
        self.check()
        state = self.storages.get(tensor.untyped_storage()._cdata)
        if state is not None and state.write is not None and self.host.get(state.write.stream.id, 0) < state.write.seq:
            raise StreamRace(f"stream race: the host reads ({op}) {state.what} that {state.write.op} on "
                             f"{state.write.stream} copies there, with no wait for it")

    def host_reads_device(self, op: str, tensor: torch.Tensor) -> None:
        """A scalar or list read of a CUDA tensor: a copy on the current stream, and the host waits for it."""
        self.launch(op, [tensor], [])
        if self.captured is None:
            self.host_waits(self.current.clock)


FACTORY = re.compile("(new_.*|.*_like)")  # CSAN's: these read their inputs' metadata alone


def accesses(func, args: tuple, kwargs: dict, out: Any) -> tuple[list[torch.Tensor], list[torch.Tensor],
                                                                list[torch.Tensor]]:
    """The tensors an operator reads, writes and makes, from its schema (CSAN's rules): an argument marked `(a!)`
    is written, one marked `(a)` is a view (neither), any other is read; a return that aliases nothing is made, and
    written unless the operator is a factory (`empty_like`, `new_zeros`: no input read either)."""
    schema = func._schema
    reads: list[torch.Tensor] = []
    writes: list[torch.Tensor] = []
    factory = bool(FACTORY.match(schema.name.split("::")[-1]))
    named = {arg.name: arg for arg in schema.arguments[len(args):]}
    pairs = list(zip(schema.arguments, args)) + [(named[k], v) for k, v in kwargs.items() if k in named]
    for arg, value in pairs:
        alias = arg.alias_info
        if (alias is None and factory) or (alias is not None and not alias.is_write):
            continue
        (writes if alias is not None else reads).extend(t for t in tree_leaves(value) if isinstance(t, torch.Tensor))
    made: list[torch.Tensor] = []
    for ret, value in zip(schema.returns, out if isinstance(out, tuple) else (out,)):
        if ret.alias_info is None:
            made.extend(t for t in tree_leaves(value) if isinstance(t, torch.Tensor))
    return reads, writes + ([] if factory else made), made
