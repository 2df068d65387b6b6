"""One-token decode steps with static shapes, captured in CUDA graphs on a GPU, for both caches; and a full cache's
forwards of several tokens a row (the PRM's scoring, the commits of whole steps) the same way.

Shapes are fixed per bucket: the rows of a step are padded to the next power of two (the padding rows write to a
reserved scratch slot or block). Per-step inputs (tokens, positions, and where each row's keys lie) live in one
static device buffer refilled before each replay (the tokens device to device, the rest from the host without
waiting for the device); the bookkeeping (lengths, blocks, compression) stays in Python, outside the graph. Without
CUDA, or with graphs off, the same static step runs eagerly: that is how the CPU tests check it against the dynamic
path. `StaticDecode` is the one mechanism; a cache's side of it (`_BoundedSide`, `_FullSide`) says what its
buffer holds and what its attention reads.

The bounded cache: attention covers a fixed span of every row's buffer, B' = budget + buffer (a row holds at most
B' - 1 entries before a decode step, since it is compressed as soon as it reaches B'), through flash-attn's
`flash_attn_with_kvcache` (per-row cache lengths, rows addressed by slot, no gather) when it is installed and the
cache is on a GPU in half precision, else through FlexAttention where it serves (`flex`: compiled on CUDA, each
slot read in place to its length, holes masked), else a masked torch SDPA over the span. Under H2O (an evictor that
accumulates) the step also computes its queries' attention probabilities over the span (`BoundedCache.receive`), which
neither kernel returns.

The full cache (vLLM's decode capture): the buffer also holds each row's block table, padded to the bucket; with
flash-attn to the table's whole width (the kernel reads each row's blocks up to its length, in place), else to the
next power of two of the blocks the longest row holds (a graph per row and block bucket; FlexAttention reading those
blocks in place, or SDPA over them gathered, masked per row). Its steps never cascade: every row reads its own blocks.
A forward of T tokens a row (`StaticDecode.append`) is bucketed by rows, blocks and T (the next power of two of the
longest row's new tokens): padding tokens write to the scratch block, each new token attends causally (the new keys
are written before the attention reads them), the head is read at each row's last real token.

On CUDA the first forward of a row bucket (and T) runs eagerly on the capture stream, its real inputs (the warm-up
that a capture needs before it); its buckets are captured from their next forward on, so a shape used once (a
commit's, the PRM's feed of a step) is never captured.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

import kvrescue.engine.flex as flex
import kvrescue.engine.invariance as invariance
from kvrescue.engine.attention import (PagedKeys, Visibility, attend_masked, attend_paged, flash_attn_with_kvcache,
                                       padded_visibility, use_flash)
from kvrescue.engine.bounded import BoundedCache, hole_free
from kvrescue.engine.caches import FullCache
from kvrescue.engine.model import Transformer
from kvrescue.engine.transfer import upload_into
from kvrescue.shapes import SCORE_BYTES, bucket, rows_at_once

_CAPTURE_STREAMS: dict[tuple[type, int], torch.cuda.Stream] = {}


def capture_stream() -> torch.cuda.Stream:
    """The side stream every capture on the current device warms up and captures on: one per device and process, as
    PyTorch keeps a cuBLAS workspace per (handle, stream) and would keep one more for each new stream (issue 41).
    Keyed by the stream class too, so that `fake_cuda`'s stand-in never serves real CUDA."""
    key = (torch.cuda.Stream, torch.cuda.current_device())
    if key not in _CAPTURE_STREAMS:
        _CAPTURE_STREAMS[key] = torch.cuda.Stream()
    return _CAPTURE_STREAMS[key]


def on_capture_stream(fn: Callable[..., Any], *args: Any) -> Any:
    """`fn(*args)` run eagerly on the current device's capture stream, after what the current stream queued, the
    current stream then waiting for it: the warm-up a capture needs there (what kernels make on first use, the
    stream's cuBLAS workspace too). Outputs read on the current stream afterwards need `record_stream`."""
    stream, current = capture_stream(), torch.cuda.current_stream()
    stream.wait_stream(current)
    with torch.cuda.stream(stream):
        out = fn(*args)
    current.wait_stream(stream)
    return out


# Without flash-attn, a bounded cache's static step reads the span of every slot of the pools in place (a view, each
# step's queries scattered to their slots) when the pools have at most this many slots per row of the bucket: a gather
# reads the rows' spans, writes them and the attention reads them again, three passes over the bucket's rows.
IN_PLACE_SLOTS = 3


class _StaticView:
    """What the decoder's attention layers see during a bounded cache's static step (the `KVCache.attend` call only).
    Without flash-attn, attention reads every slot's span in place: through FlexAttention where it serves (`flex`,
    each slot its own batch entry, holes masked), else where `IN_PLACE_SLOTS` says SDPA over a view; otherwise the
    rows' spans gathered."""

    def __init__(self, cache: BoundedCache, inputs: torch.Tensor, span: int) -> None:
        self.cache, self.span = cache, span
        self.slots, self.lengths = inputs[2], inputs[3]
        self.holes = cache.evictor.allocates  # the rows' heads' holes masked (`bounded.hole_free`)
        if self.holes:
            self.base, self.held = inputs[4], inputs[5:].view(cache.k.shape[0], cache.k.shape[2], -1)
        slots = cache.k.shape[1]
        self.flash = use_flash(cache.k) and not self.holes
        tiles = None if self.flash or not flex.serves(cache.k) else flex.span_tiles(span, cache.capacity)
        self.flex = None if tiles is None else flex.SlotSteps(slots, self.slots, self.lengths, tiles,
                                                               cache.q.shape[2] // cache.k.shape[2],
                                                               self.base if self.holes else None)
        self.in_place = (not self.holes and not self.flash and tiles is None
                         and slots <= IN_PLACE_SLOTS * inputs.shape[1])
        if self.in_place:  # each slot's cached entries (0 for slots outside the step: they see their key 0 alone)
            held = torch.zeros(slots, dtype=torch.long, device=inputs.device).index_copy_(0, self.slots, self.lengths)
            self.visible = Visibility((torch.arange(span, device=inputs.device) <= held[:, None])[:, None])
        elif not self.holes and not self.flash and self.flex is None:  # the rows' spans gathered: cached entries, own
            self.padded = Visibility(padded_visibility(self.lengths, torch.ones_like(self.lengths), 1, span))

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        kp, vp = self.cache.store_token(layer, self.slots, self.lengths, q, k, v)
        if self.cache.received is not None:  # H2O: the step's query against the span's keys, once more
            visible = (torch.arange(self.span, device=q.device) <= self.lengths[:, None])[:, None]
            self.cache.receive(layer, self.slots, q, kp[self.slots, :, : self.span], visible, self.lengths)
        if self.flash:
            out = flash_attn_with_kvcache(q.transpose(1, 2), kp.transpose(1, 2), vp.transpose(1, 2),
                                          cache_seqlens=(self.lengths + 1).int(), cache_batch_idx=self.slots.int(),
                                          num_splits=invariance.flash_splits())
            return out.transpose(1, 2)
        if self.flex is not None:
            return self.flex.attend(q, kp, vp, self.held[layer].T if self.holes else None)
        if self.in_place:
            queries = q.new_zeros(kp.shape[0], *q.shape[1:]).index_copy_(0, self.slots, q)
            out = attend_masked(queries, kp[:, :, : self.span], vp[:, :, : self.span], self.visible)
            return out.index_select(0, self.slots)
        keys, values = kp[self.slots, :, : self.span], vp[self.slots, :, : self.span]
        if self.holes:
            visible = (torch.arange(self.span, device=q.device) <= self.lengths[:, None])[:, None, None]
            held = self.held[layer].transpose(0, 1)  # [R, Hkv]
            return attend_masked(q, keys, values, visible & hole_free(held, self.base, self.span))
        return attend_masked(q, keys, values, self.padded)


class _BoundedSide:
    """A bounded cache's side of a static step. Buffer rows: tokens, logical positions, slots, physical lengths, and
    for an allocating evictor the rows' `base` and `held` (layer by layer, KV head by KV head)."""

    def __init__(self, cache: BoundedCache) -> None:
        self.cache = cache
        self.scratch = cache.reserve_slot()

    @property
    def generation(self) -> int:
        return self.cache.generation

    def start(self, rows: Sequence[int]) -> tuple[tuple[int, ...], np.ndarray]:
        """The step's bucket (the arguments of `padding`) and its buffer on the host (the tokens' row left 0)."""
        cache, ids = self.cache, np.asarray(rows, np.int64)
        host = self.padding(bucket(len(rows)))
        host[1:4, : len(rows)] = cache.row_logical[ids], cache.row_slot[ids], cache.row_physical[ids]
        if cache.evictor.allocates:
            host[4, : len(rows)] = cache.row_base[ids]
            host[5:, : len(rows)] = cache.row_held[ids].reshape(len(rows), -1).T
        return (host.shape[1],), host

    def padding(self, size: int) -> np.ndarray:
        """The buffer of `size` padding rows (no holes)."""
        n_layers, _, h_kv = self.cache.k.shape[:3]
        host = np.zeros((4 + (1 + n_layers * h_kv) * self.cache.evictor.allocates, size), np.int64)
        host[2] = self.scratch
        return host

    @staticmethod
    def tokens(key: tuple[int, ...]) -> int:
        """New tokens a row of the bucket `key` appends: one."""
        return 1

    def view(self, inputs: torch.Tensor, tokens: int) -> _StaticView:
        return _StaticView(self.cache, inputs, self.cache.trigger)

    def finish(self, rows: Sequence[int]) -> None:
        self.cache.advance(rows)


class _FullView:
    """What the decoder's attention layers see during a full cache's static forward of `tokens` tokens a row: each
    row's new k/v written to their slots (padding tokens and rows: the scratch block), then attention over its
    blocks, each new token causally over its row's cached keys and the new ones before it (flash-attn's paged kernel
    or FlexAttention, in place; else SDPA over the bucket's blocks gathered, masked per row)."""

    def __init__(self, cache: FullCache, inputs: torch.Tensor, tokens: int) -> None:
        self.cache = cache
        self.cached = inputs[tokens]  # the first new token's position: the row's cached keys
        self.slots = inputs[2 * tokens: 3 * tokens].T.reshape(-1)  # row after row, token after token
        self.table = inputs[3 * tokens + 1:].T  # [size, width]
        self.flash = use_flash(cache.k)
        self.flex = None
        if not self.flash and flex.serves(cache.k, tokens, inputs.shape[1]):
            new = inputs[3 * tokens] + 1 if tokens > 1 else None  # each row's new tokens (padding rows: 1)
            self.flex = flex.PagedSteps(self.table, self.cached, cache.k.shape[1], cache.block_size, tokens, new)
        elif not self.flash:
            keys = torch.arange(self.table.shape[1] * cache.block_size, device=inputs.device)
            horizon = self.cached[:, None] + torch.arange(tokens, device=inputs.device)  # [size, tokens]
            self.blocks = self.table.reshape(-1)  # each row's blocks, row after row
            self.visible = Visibility(keys <= horizon[:, :, None])

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        cache = self.cache
        kp, vp = cache.store_at(layer, self.slots, k, v)
        if self.flash:
            return attend_paged(q, kp, vp, PagedKeys(self.table.contiguous(), self.cached, causal=True))[0]
        if self.flex is not None:
            return self.flex.attend(q, kp, vp)[0]
        R, heads_dim = q.shape[0], kp.shape[2:]
        keys, values = (pool.index_select(0, self.blocks).view(R, -1, *heads_dim).transpose(1, 2) for pool in (kp, vp))
        return attend_masked(q, keys, values, self.visible)


class _FullSide:
    """A full cache's side of a static forward of T tokens a row (T = 1: a decode step). Buffer rows: T of tokens,
    T of positions, T of write slots, the index of each row's last new token, then the block table (transposed),
    padded to the bucket's width. A bucket is (rows, width, T)."""

    def __init__(self, cache: FullCache) -> None:
        self.cache = cache
        self.scratch = cache.reserve_block()
        self.generation = 0  # the pools are never reallocated once the scratch block is there

    def start(self, rows: Sequence[int], n_new: np.ndarray | None = None) -> tuple[tuple[int, ...], np.ndarray]:
        """Room for n_new[i] (default 1) more tokens in rows[i]; the bucket and the buffer on the host (the tokens'
        rows left 0)."""
        cache, ids = self.cache, np.asarray(rows, np.int64)
        n_new = np.ones(len(ids), np.int64) if n_new is None else n_new
        cached = cache.append_rows(rows, n_new)
        T = bucket(int(n_new.max()))
        host = self.padding(bucket(len(rows)), self._width(int(cache.block_table.n_blocks[ids].max()), T), T)
        bs, width, R = cache.block_size, host.shape[0] - 3 * T - 1, len(rows)
        table = cache.block_table.table[ids, : min(width, cache.block_table.table.shape[1])]
        positions = cached[:, None] + np.arange(T)  # [R, T]
        real = np.arange(T) < n_new[:, None]
        column = np.minimum(positions // bs, table.shape[1] - 1)  # padding tokens' own: any (they write to scratch)
        slots = np.where(real, table[np.arange(R)[:, None], column] * bs + positions % bs, self.scratch * bs)
        host[T: 2 * T, :R], host[2 * T: 3 * T, :R], host[3 * T, :R] = positions.T, slots.T, n_new - 1
        host[3 * T + 1: 3 * T + 1 + table.shape[1], :R] = table.T
        return (host.shape[1], width, T), host

    def padding(self, size: int, width: int, tokens: int = 1) -> np.ndarray:
        """The buffer of `size` padding rows of `tokens` tokens and a `width`-block table."""
        host = np.full((3 * tokens + 1 + width, size), self.scratch, np.int64)
        host[: 2 * tokens] = 0
        host[2 * tokens: 3 * tokens] = self.scratch * self.cache.block_size
        host[3 * tokens] = 0
        return host

    @staticmethod
    def tokens(key: tuple[int, ...]) -> int:
        """New tokens a row of the bucket `key` appends."""
        return key[2]

    def rows_at_once(self, rows: Sequence[int], n_new: np.ndarray, group: int) -> int:
        """Rows of one forward appending n_new[i] tokens to rows[i] (`group` query heads a KV head): all of them,
        unless SDPA's mask over the bucket's gathered blocks (each row's grouped queries x keys, in the pools' dtype)
        would pass SCORE_BYTES, where the eager path reads in chunks: then the largest power of two within it."""
        cache = self.cache
        if use_flash(cache.k):
            return len(rows)
        bs, T = cache.block_size, bucket(int(n_new.max()))
        blocks = int((-(-(cache.block_table.lengths[np.asarray(rows, np.int64)] + n_new) // bs)).max())
        return rows_at_once(len(rows), group * T * self._width(blocks, T) * bs * cache.k.element_size(), SCORE_BYTES)

    def _width(self, blocks: int, tokens: int) -> int:
        """Table columns a forward reads: the whole table for flash-attn (and the columns its padding tokens reach
        past it), else the bucket of the rows' blocks (whole KEY_GRANULE blocks of keys with batch invariance on)."""
        cache = self.cache
        if use_flash(cache.k):
            return cache.block_table.table.shape[1] + -(-(tokens - 1) // cache.block_size)
        if invariance.active(cache.k):
            return invariance.padded_keys(blocks * cache.block_size) // cache.block_size
        return bucket(blocks)

    def view(self, inputs: torch.Tensor, tokens: int) -> _FullView:
        return _FullView(self.cache, inputs, tokens)

    def finish(self, rows: Sequence[int]) -> None:
        pass  # `start` counted the tokens


@dataclass
class _Step:
    inputs: torch.Tensor  # [fields, bucket]: the tokens, then the cache side's rows (positions first)
    tokens: int = 1  # new tokens a row
    logits: torch.Tensor | None = None
    graph: torch.cuda.CUDAGraph | None = None


class StaticDecode:
    """`net.decode` over a `BoundedCache` or a `FullCache` with static shapes, and over a `FullCache` forwards of
    several tokens a row (`append`); captured once per bucket on CUDA."""

    def __init__(self, net: Transformer, cache: BoundedCache | FullCache, graphs: bool = True) -> None:
        self.net, self.cache = net, cache
        self.side = _BoundedSide(cache) if isinstance(cache, BoundedCache) else _FullSide(cache)
        self.graphs = graphs and cache.k.is_cuda
        self.steps: dict[tuple[int, ...], _Step] = {}
        self.pools_from = self.side.generation  # the pools the graphs read (their addresses and strides)
        self.memory = torch.cuda.graph_pool_handle() if self.graphs else None
        # each (row bucket, tokens)'s head outputs, shared by its graphs (block buckets)
        self.outputs: dict[tuple[int, ...], torch.Tensor] = {}

    @property
    def scratch(self) -> int:
        """The slot (bounded cache) or block (full cache) the padding rows write to."""
        return self.side.scratch

    @torch.inference_mode()
    def __call__(self, rows: list[int], tokens: torch.Tensor | list[int]) -> torch.Tensor:
        """Append one token (tokens [R], best on the cache's device) to each row; the head outputs that
        follow [R, out] (`_run`: valid until the bucket's next forward)."""
        tokens = torch.as_tensor(tokens, device=self.cache.k.device)
        self._check_pools()
        return self._run(rows, *self.side.start(rows), tokens)

    @torch.inference_mode()
    def append(self, rows: list[int], token_lists: Sequence[Sequence[int]]) -> torch.Tensor:
        """Append token_lists[i] (non-empty, on the host) to rows[i] of a full cache in one static forward, padded to
        the bucket of the longest (in several where SDPA's mask would be too large, `_FullSide.rows_at_once`); the
        head outputs after each row's last token [R, out] (`_run`: valid until the bucket's next forward; several
        forwards' are concatenated)."""
        if not isinstance(self.side, _FullSide):
            raise TypeError("StaticDecode.append: forwards of several tokens a row are a full cache's")
        self._check_pools()
        n_new = np.fromiter(map(len, token_lists), np.int64, len(token_lists))
        if n_new.min(initial=1) < 1:
            raise ValueError("StaticDecode.append: every row needs at least one token")
        at_once = self.side.rows_at_once(rows, n_new, self.net.args.n_heads // self.net.args.n_kv_heads)
        parts = [self._append(rows[i: i + at_once], token_lists[i: i + at_once], n_new[i: i + at_once])
                 for i in range(0, len(rows), at_once)]
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def _append(self, rows: list[int], token_lists: Sequence[Sequence[int]], n_new: np.ndarray) -> torch.Tensor:
        key, host = self.side.start(rows, n_new)
        for i, tokens in enumerate(token_lists):
            host[: len(tokens), i] = tokens
        return self._run(rows, key, host)

    def _check_pools(self) -> None:
        if self.side.generation != self.pools_from:  # reallocated: the graphs read the old pools (even at one address)
            self.steps.clear()
            self.pools_from = self.side.generation

    def _run(self, rows: list[int], key: tuple[int, ...], host: np.ndarray,
             tokens: torch.Tensor | None = None) -> torch.Tensor:
        """The forward of the bucket `key` (or one prepared that covers it) over the buffer `host`; `tokens`: the
        one-token steps' tokens, on the device, in place of the buffer's first row. Its head outputs [R, out]: with
        graphs, a view of the bucket's outputs buffer, which its next replay overwrites (the callers copy or read
        them at once, on the same stream), so a step copies no [rows, vocab] logits it need not."""
        key, host = self._captured_cover(key, host)
        step = self.steps.get(key) or self._prepare(key, host)
        upload_into(step.inputs, host)  # no wait for the device
        if tokens is not None:
            step.inputs[0, : len(rows)].copy_(tokens)
        if self.graphs and step.graph is None and (step.inputs.shape[1], step.tokens) in self.outputs:
            step.graph, step.logits = self._capture(step.inputs, step.tokens)
        if step.graph is not None:
            step.graph.replay()
            logits = step.logits
        elif self.graphs:
            logits = self._warm_up(step.inputs, step.tokens)
        else:
            logits = self._forward(step.inputs, step.tokens)
        self.side.finish(rows)
        return logits[: len(rows)]

    def _captured_cover(self, key: tuple[int, ...], host: np.ndarray) -> tuple[tuple[int, ...], np.ndarray]:
        """The smallest bucket prepared already that covers `key` (as many rows or more, as wide a table or wider, as
        many tokens), with `host` padded to it: a step of few rows (a commit's) takes a bucket of more rather than
        preparing one of its own (a warm-up, then a capture); `key` itself when none covers it."""
        covers = [k for k in self.steps
                  if k != key and k[2:] == key[2:] and all(a >= b for a, b in zip(k, key))]
        if key in self.steps or not covers:
            return key, host
        cover = min(covers, key=lambda k: (int(np.prod(k)), k))
        padded = self.side.padding(*cover)
        padded[: host.shape[0], : host.shape[1]] = host
        return cover, padded

    def _forward(self, inputs: torch.Tensor, tokens: int = 1) -> torch.Tensor:
        """The head outputs after each row's last new token [size, out]."""
        h = self.net.decoder(inputs[:tokens].T, inputs[tokens: 2 * tokens].T, self.side.view(inputs, tokens))
        if tokens == 1:
            return self.net.head(h[:, 0])
        return self.net.head(h[torch.arange(h.shape[0], device=h.device), inputs[3 * tokens]])

    def _prepare(self, key: tuple[int, ...], host: np.ndarray) -> _Step:
        step = _Step(torch.zeros(host.shape, dtype=torch.long, device=self.cache.k.device), self.side.tokens(key))
        self.steps[key] = step
        return step

    def _warm_up(self, inputs: torch.Tensor, tokens: int) -> torch.Tensor:
        """The first forward of a row bucket and tokens, eagerly on the device's capture stream (its real inputs, its
        outputs returned): it makes what the kernels create on first use there (the stream's cuBLAS workspace too, as
        nano-vllm's warm-up forward before each batch size's capture does) and gives the shape's outputs buffer its
        shape. Its graphs come from the shape's next forward on (`_capture`), so that a shape used once (a commit's,
        the PRM's feed of a step) costs one forward, not a warm-up, a capture and a replay."""
        torch.cuda.set_device(inputs.device)  # the capture stream is the current device's: the cache's
        logits = on_capture_stream(self._forward, inputs, tokens)
        logits.record_stream(torch.cuda.current_stream())  # read on this stream (the caller's copy)
        self.outputs[inputs.shape[1], tokens] = torch.empty_like(logits)
        return logits

    def _capture(self, inputs: torch.Tensor, tokens: int = 1) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        """The forward over `inputs` captured in a CUDA graph on the device's capture stream, and its outputs buffer:
        the (row bucket, tokens)'s, which every graph of those writes (a full cache has one per block bucket), made by
        the shape's warm-up (`_warm_up`); a wider block table of the same rows launches the same kernels, the
        attention's over more keys: captured at its first forward. The graph reads and writes the pools at their
        addresses and strides of now."""
        torch.cuda.set_device(inputs.device)  # the capture stream and graph are the current device's: the cache's
        logits = self.outputs[inputs.shape[1], tokens]
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.memory, stream=capture_stream()):
            logits.copy_(self._forward(inputs, tokens))
        return graph, logits
