"""A decode iteration's sampling, step ends and detector (`steps.StepDecoder`) with static shapes, captured in a CUDA
graph per bucket of live lanes on a GPU.

The iteration's inputs (each live lane, its row of the kept logits, its screened flag) live in one static int64
buffer [3, bucket] per bucket (a power of two), refilled from the host before each replay without waiting for the
device (`transfer.upload_into`). The padding columns are zeros: lane 0, which a static decoder reserves as scratch, row
0 of the kept logits, not screened; what they compute lands in the scratch lane and past the live columns of the
outputs, which nobody reads. The outputs (tokens, and the packed float64 [5, bucket] the host reads) are static
buffers too, made outside the captures. Without CUDA, or with graphs off, a static decoder runs the same iteration
eagerly over the same padded buffer: that is how the CPU tests check it against the unpadded call (a runner's decoder
is static only where it captures, unless `Runner(static_sampling=True)`; elsewhere it runs the live lanes alone).

A graph reads the lane state and the runner's kept logits at their addresses of its capture: when either is
reallocated (`reads`: the lanes grew, the logits buffer grew), the graphs are captured again, as `graphs.StaticDecode`
does when a cache's pools are. Captures warm up once per bucket and capture on `graphs.capture_stream()`, in the
runner's graph memory pool where it has one (every output of a graph is made outside it, so the graphs of one pool
share only temporaries, and one runner replays them one after another on its stream).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from kvrescue.engine.graphs import capture_stream, on_capture_stream
from kvrescue.engine.transfer import upload_into
from kvrescue.shapes import bucket

Iterate = Callable[[Any, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]  # (runner, inputs) -> tokens, packed


@dataclass
class _Bucket:
    inputs: torch.Tensor  # [3, bucket] int64: lanes, rows, screened flags
    outputs: tuple[torch.Tensor, torch.Tensor] | None = None  # a graph's tokens and packed results
    graph: torch.cuda.CUDAGraph | None = None


class StaticIterations:
    """An iteration (`iterate(runner, inputs)`) over the live lanes padded to their bucket; captured once per bucket on
    CUDA. The iteration is passed in at each call, not kept: it is its decoder's method, and the decoder holds this
    (a reference back would make a cycle that keeps a finished cell's lanes until a full garbage collection)."""

    def __init__(self, device: torch.device, graphs: bool, pool: Any = None) -> None:
        self.device = device
        self.graphs = graphs and device.type == "cuda"
        self.memory = (pool or torch.cuda.graph_pool_handle()) if self.graphs else None
        self.buckets: dict[int, _Bucket] = {}
        self.reads: tuple[torch.Tensor, ...] = ()  # what the graphs read by address (held, so never reused)
        self.outputs: dict[int, tuple[torch.Tensor, ...]] = {}  # each bucket's, shared by its captures

    def __call__(self, iterate: Iterate, runner, host: np.ndarray,
                 reads: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`iterate` over the lanes of `host` ([3, live] int64); `reads`: the tensors it reads by address. The
        inputs buffer, the tokens [bucket] and the packed results [5, bucket] (the live lanes first)."""
        if len(reads) != len(self.reads) or any(a is not b for a, b in zip(reads, self.reads)):
            self.buckets.clear()  # reallocated: the graphs read the old tensors
            self.reads = reads
        size = bucket(host.shape[1])
        step = self.buckets.get(size) or self._prepare(iterate, runner, host.shape[0], size)
        padded = np.zeros((host.shape[0], size), np.int64)
        padded[:, : host.shape[1]] = host
        upload_into(step.inputs, padded)
        if step.graph is None:
            return step.inputs, *iterate(runner, step.inputs)
        step.graph.replay()
        return step.inputs, *step.outputs

    def _prepare(self, iterate: Iterate, runner, fields: int, size: int) -> _Bucket:
        step = _Bucket(torch.zeros(fields, size, dtype=torch.long, device=self.device))  # padding only
        if self.graphs:
            step.graph, step.outputs = self._capture(iterate, runner, step.inputs)
        self.buckets[size] = step
        return step

    def _capture(self, iterate: Iterate, runner,
                 inputs: torch.Tensor) -> tuple[torch.cuda.CUDAGraph, tuple[torch.Tensor, ...]]:
        """The iteration over `inputs` (padding only: it writes the scratch lane alone) captured on the capture
        stream, into the bucket's outputs; a bucket's first capture comes after one warm-up there (kernels made on
        first use), which also gives the outputs their shapes."""
        torch.cuda.set_device(inputs.device)  # the capture stream and graph are the current device's (indexed)
        size = inputs.shape[1]
        if size not in self.outputs:
            warm = on_capture_stream(iterate, runner, inputs)
            self.outputs[size] = tuple(torch.empty_like(value) for value in warm)
            del warm
        outputs = self.outputs[size]
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.memory, stream=capture_stream()):
            for out, value in zip(outputs, iterate(runner, inputs)):
                out.copy_(value)
        return graph, outputs
