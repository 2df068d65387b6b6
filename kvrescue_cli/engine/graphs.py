"""The bounded cache's one-token decode step with static shapes, captured in CUDA graphs on a GPU.

Shapes are fixed per row bucket: the rows of a step are padded to the next power of two (the
padding rows write to a reserved scratch slot), and attention covers a fixed span of every row's
buffer, B' = budget + buffer (a row holds at most B' - 1 entries before a decode step, since it is
compressed as soon as it reaches B'). Per-step inputs (tokens, slots, lengths, positions) live in one static
device buffer refilled before each replay (the tokens device to device, the rest from the host without
waiting for the device); the bookkeeping (lengths, compression) stays in Python,
outside the graph. Without CUDA, or with graphs off, the same static step runs eagerly: that is how
the CPU tests check it against the dynamic path.

Attention uses flash-attn's `flash_attn_with_kvcache` (per-row cache lengths, rows addressed by
slot, no gather) when it is installed and the cache is on a GPU in half precision, else a masked
torch SDPA over the gathered span. Under H2O (an evictor that accumulates) the step also computes its
queries' attention probabilities over the span (`BoundedCache.receive`), which flash-attn does not return.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

import kvrescue_cli.engine.invariance as invariance
from kvrescue_cli.engine.attention import attend_padded, flash_attn_with_kvcache, use_flash
from kvrescue_cli.engine.bounded import BoundedCache
from kvrescue_cli.engine.model import Transformer
from kvrescue_cli.engine.transfer import upload


def bucket(rows: int) -> int:
    """The row bucket: the next power of two."""
    return 1 << max(rows - 1, 0).bit_length()


class _StaticView:
    """What the decoder's attention layers see during a static step (the `KVCache.attend` call only)."""

    def __init__(self, cache: BoundedCache, inputs: torch.Tensor, span: int) -> None:
        self.cache, self.span = cache, span
        self.slots, self.lengths = inputs[1], inputs[2]

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        self.cache.store_token(layer, self.slots, self.lengths, q, k, v)
        kp, vp = self.cache.k[layer], self.cache.v[layer]
        if self.cache.received is not None:  # H2O: the step's query against the span's keys, once more
            visible = (torch.arange(self.span, device=q.device) <= self.lengths[:, None])[:, None]
            self.cache.receive(layer, self.slots, q, kp[self.slots, :, : self.span], visible, self.lengths)
        if use_flash(q):
            out = flash_attn_with_kvcache(q.transpose(1, 2), kp.transpose(1, 2), vp.transpose(1, 2),
                                          cache_seqlens=(self.lengths + 1).int(), cache_batch_idx=self.slots.int(),
                                          num_splits=invariance.flash_splits())
            return out.transpose(1, 2)
        keys, values = kp[self.slots, :, : self.span], vp[self.slots, :, : self.span]
        return attend_padded(q, keys, values, self.lengths, torch.ones_like(self.lengths))


@dataclass
class _Step:
    inputs: torch.Tensor  # [4, bucket]: tokens, slots, physical lengths, logical positions
    logits: torch.Tensor | None = None
    graph: torch.cuda.CUDAGraph | None = None


class StaticDecode:
    """`net.decode` over a `BoundedCache` with static shapes; captured once per row bucket on CUDA."""

    def __init__(self, net: Transformer, cache: BoundedCache, graphs: bool = True) -> None:
        self.net, self.cache = net, cache
        self.graphs = graphs and cache.k.is_cuda
        self.scratch = cache.reserve_slot()
        self.span = cache.trigger
        self.steps: dict[int, _Step] = {}
        self.pools_from = cache.generation  # the pools the graphs read (their addresses and strides)
        self.memory = torch.cuda.graph_pool_handle() if self.graphs else None

    @torch.inference_mode()
    def __call__(self, rows: list[int], tokens: torch.Tensor | list[int]) -> torch.Tensor:
        """Append one token (tokens [R], best on the cache's device) to each row; the head outputs that
        follow [R, out] (a fresh tensor)."""
        cache = self.cache
        tokens = torch.as_tensor(tokens, device=cache.k.device)
        if cache.generation != self.pools_from:  # reallocated: the graphs read the old pools (even at one address)
            self.steps.clear()
            self.pools_from = cache.generation
        size = bucket(len(rows))
        step = self.steps.get(size) or self._prepare(size)
        ids = np.asarray(rows, np.int64)
        host = np.zeros((3, size), np.int64)
        host[0] = self.scratch
        host[:, : len(rows)] = cache.row_slot[ids], cache.row_physical[ids], cache.row_logical[ids]
        step.inputs[1:].copy_(upload(host, step.inputs.device))  # no wait for the device
        step.inputs[0, : len(rows)].copy_(tokens)
        if step.graph is not None:
            step.graph.replay()
            logits = step.logits
        else:
            logits = self._forward(step.inputs)
        cache.advance(rows)
        return logits[: len(rows)].clone()

    def _forward(self, inputs: torch.Tensor) -> torch.Tensor:
        positions = inputs[3][:, None]
        h = self.net.decoder(inputs[0][:, None], positions, _StaticView(self.cache, inputs, self.span))
        return self.net.head(h[:, 0])

    def _prepare(self, size: int) -> _Step:
        inputs = torch.zeros(4, size, dtype=torch.long, device=self.cache.k.device)
        step = _Step(inputs)
        if self.graphs:
            inputs[1] = self.scratch  # warm-up and capture write only to the scratch slot
            step.graph, step.logits = self._capture(inputs)
        self.steps[size] = step
        return step

    def _capture(self, inputs: torch.Tensor) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        """The step over `inputs` captured in a CUDA graph (after a warm-up on a side stream), and its logits
        buffer. The graph reads and writes the pools at their addresses and strides of now."""
        torch.cuda.set_device(inputs.device)  # the capture stream and graph are the current device's: the cache's
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                self._forward(inputs)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.memory):
            logits = self._forward(inputs)
        return graph, logits
