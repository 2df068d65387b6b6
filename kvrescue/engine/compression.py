"""The bounded cache's compression: each row that reached B' = budget + buffer entries is cut to `budget` per layer
and KV head by its evictor (`evictors.registry.keep_positions`), or by an allocating policy's per-layer budgets."""

from __future__ import annotations

from typing import Protocol

import numpy as np
import torch

from kvrescue.engine.evictors.base import Evictor, gather_positions
from kvrescue.engine.evictors.registry import keep_positions
from kvrescue.engine.transfer import upload, upload_all
from kvrescue.shapes import OBSERVATION_WINDOW, compress_slice


class Compressible(Protocol):
    """What compression reads and rewrites of `bounded.BoundedCache`: its pools and its rows' host bookkeeping."""

    k: torch.Tensor  # [layers, rows, Hkv, capacity, d]
    v: torch.Tensor
    q: torch.Tensor  # [layers, rows, H, OBSERVATION_WINDOW, d]: the last queries
    received: torch.Tensor | None
    row_slot: np.ndarray
    row_physical: np.ndarray
    row_base: np.ndarray
    row_held: np.ndarray
    evictor: Evictor
    budget: int
    layer_budgets: list[int]
    trigger: int


def compress(cache: Compressible, rows: np.ndarray) -> None:
    """Compress each row to `budget` entries per layer and KV head (an allocating policy: `_allocate`). Rows of
    equal length are scored together, all layers in one call, as many rows at once as `compress_slice` lets fit
    in COMPRESS_BYTES; a row longer than that (a long prompt or step) some layers, or some KV heads of a layer,
    at a time. Each (layer, KV head) is scored on its own entries and queries alone, so the slicing changes no
    kept position."""
    n_layers, _, h_kv, _, _ = cache.k.shape
    lengths = cache.row_physical[rows]
    for length in np.unique(lengths).tolist():
        equal = rows[lengths == length]
        cut = compress_slice(n_layers, h_kv, length)
        for start in range(0, len(equal), cut.rows):
            part = equal[start:start + cut.rows]
            slots = upload(cache.row_slot[part], cache.k.device)
            if cache.evictor.allocates:
                _allocate(cache, part, slots, length, cut.layers * cut.kv_heads * cut.rows)
                continue
            for layer in range(0, n_layers, cut.layers):
                for head in range(0, h_kv, cut.kv_heads):
                    layers, heads = slice(layer, layer + cut.layers), slice(head, head + cut.kv_heads)
                    _compress(cache, slots, length, layers, heads)
            cache.row_physical[part] = cache.row_base[part] = cache.budget
            cache.row_held[part] = cache.budget


def _compress(cache: Compressible, slots: torch.Tensor, length: int, layers: slice, heads: slice) -> None:
    """Keep `budget` of the first `length` entries of these slots' layers and KV heads (scored with the queries
    of their query heads)."""
    group = cache.q.shape[2] // cache.k.shape[2]  # query heads per KV head
    queries = slice(heads.start * group, heads.stop * group)
    keys = cache.k[layers, slots, heads, :length]
    received = None if cache.received is None else cache.received[layers, slots, heads, :length]
    kept = keep_positions(cache.evictor, keys, cache.q[layers, slots, queries], cache.budget, received)
    cache.k[layers, slots, heads, : cache.budget] = gather_positions(keys, kept)
    cache.v[layers, slots, heads, : cache.budget] = gather_positions(cache.v[layers, slots, heads, :length], kept)
    if received is not None:
        cache.received[layers, slots, heads, : cache.budget] = received.gather(-1, kept)


def _allocate(cache: Compressible, rows: np.ndarray, slots: torch.Tensor, length: int, at_once: int) -> None:
    """An allocating policy's compression of rows of physical `length`: each (layer, row, KV head) scored on the
    entries it holds (`held` then those from `base` on, gathered), `at_once` of equal count together; each layer
    keeps the past positions its policy's `keep_past` picks within its budget, and the last OBSERVATION_WINDOW.
    The host reads the counts kept back (a wait for the device). No allocating policy `accumulates`."""
    n_layers, _, h_kv, _, d = cache.k.shape
    group = cache.q.shape[2] // h_kv
    held = cache.row_held[rows].transpose(1, 0, 2)  # [layers, R, Hkv]
    holes = cache.row_base[rows, None] - held  # between the kept entries and those appended since
    counts = held + length - cache.row_base[rows, None]  # entries held
    scores = torch.full((n_layers, len(rows), h_kv, length - OBSERVATION_WINDOW), -torch.inf, device=cache.k.device)
    compact = torch.arange(length, device=cache.k.device)
    dev = upload_all({"held": held, "holes": holes, "counts": counts}, cache.k.device)
    physical = compact + (compact >= dev["held"][..., None]) * dev["holes"][..., None]  # [layers, R, Hkv, length]
    for n in np.unique(counts).tolist():
        where = np.argwhere(counts == n)
        for start in range(0, len(where), at_once):
            layer, row, head = upload(where[start:start + at_once].T.copy(), cache.k.device)
            at = physical[layer, row, head, :n]
            keys = cache.k[layer, slots[row], head, :length].gather(1, at[..., None].expand(-1, -1, d))
            queries = cache.q[layer[:, None], slots[row][:, None],
                             head[:, None] * group + torch.arange(group, device=cache.k.device)]
            past = cache.evictor.score(keys[:, None], queries)[:, 0]
            scores[layer, row, head, : n - OBSERVATION_WINDOW] = past.to(scores.dtype)
    keep = torch.zeros(n_layers, len(rows), h_kv, length, dtype=torch.bool, device=cache.k.device)
    for layer, budget in enumerate(cache.layer_budgets):
        keep[layer, ..., : length - OBSERVATION_WINDOW] = cache.evictor.keep_past(scores[layer], budget,
                                                                                cache.trigger - OBSERVATION_WINDOW)
    n = dev["counts"][..., None]
    keep |= (compact >= n - OBSERVATION_WINDOW) & (compact < n)
    kept = keep.sum(-1)
    widest = int(kept.max())
    order = torch.sort(~keep, dim=-1, stable=True).indices[..., :widest]  # kept compact positions, ascending
    at = physical.gather(-1, order)  # [layers, R, Hkv, widest]
    for pool in (cache.k, cache.v):
        pool[:, slots, :, :widest] = gather_positions(pool[:, slots, :, :length], at)
    kept = kept.cpu().numpy().transpose(1, 0, 2)
    cache.row_held[rows] = kept
    cache.row_physical[rows] = cache.row_base[rows] = kept.max(axis=(1, 2))
