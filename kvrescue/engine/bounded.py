"""The base model's bounded evicting KV cache (DESIGN section 3).

Every forward attends over everything appended so far; afterwards each row whose physical length
reached B' = budget + buffer is compressed to exactly `budget` entries, per layer and KV head, by the
run's evictor (`compression.compress`). A row's peak is B' - 1 + its largest append; in steady decoding
it cycles budget -> B' -> budget. Tokens keep their logical positions: RoPE is applied before caching
and new tokens are placed at the row's logical length, never at its physical length.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

import kvrescue.engine.flex as flex
import kvrescue.engine.invariance as invariance
from kvrescue.engine.attention import Visibility, attend_masked, padded_visibility
from kvrescue.engine.caches import KVCache, layer_views
from kvrescue.engine.compression import compress
from kvrescue.engine.evictors.base import Evictor
from kvrescue.engine.evictors.h2o import received_attention
from kvrescue.engine.evictors.registry import EVICTORS, evictor_named
from kvrescue.engine.transfer import upload_all
from kvrescue.evictor_catalogue import MIN_BUDGET
from kvrescue.shapes import BUFFER, OBSERVATION_WINDOW


@dataclass
class _BoundedForward:
    rows: np.ndarray
    slots: torch.Tensor | slice  # [R] pool slots of the rows, or a slice when they are consecutive
    kv_lengths: torch.Tensor     # [R] physical entries before this forward
    new_lengths: torch.Tensor    # [R]
    length: int                  # keys attended: the max physical length after the append (whole blocks: `invariance`)
    write_slots: torch.Tensor    # [N] slot of each valid new token
    write_pos: torch.Tensor      # [N] its physical index
    valid: torch.Tensor          # [N] its flat index (row * T + t) among the forward's padded tokens
    window: torch.Tensor | None  # [R, 1, OBSERVATION_WINDOW, 1] where the new ring lies in (old ring ++ new queries)
    visible: Visibility          # [R, T, length] the keys each new token attends to (`padded_visibility`)
    held: torch.Tensor | None    # [R, layers, Hkv] (an allocating evictor) entries each kept at its last compression
    base: torch.Tensor | None    # [R] its physical length then; the entries between are holes (`hole_free`)
    in_place: flex.SlotSteps | None = None  # a one-token step through FlexAttention, where it serves


def hole_free(held: torch.Tensor, base: torch.Tensor, length: int) -> torch.Tensor:
    """Which of a layer's first `length` entries each row's KV heads hold, [R, Hkv, 1, length]: those its last
    compression kept (before `held` [R, Hkv]) and those appended since (from `base` [R] on), not the holes between,
    where an allocating evictor left a head fewer than the row's widest. Both decodes read it."""
    j = torch.arange(length, device=held.device)
    return ((j < held[..., None]) | (j >= base[:, None, None]))[:, :, None]


class BoundedCache(KVCache):
    """Per row a fixed-capacity K/V buffer, its physical and logical lengths, and per layer a ring of
    the last OBSERVATION_WINDOW post-RoPE queries (R-KV's observation window).

    Each (layer, KV head) of a row holds the entries its last compression kept at the front of its buffer, `held`
    of them, and those appended since from the row's physical length then, `base`, on: the same physical positions
    for every head. A policy that `allocates` (PyramidKV, Ada-KV) keeps a head fewer than the row's widest, and
    attention masks the holes between (`hole_free`); any other keeps every head `budget`, holding no hole.

    Pools (gpt-fast style, written in place): K and V [layers, slots, kv_heads, capacity, head_dim]
    and queries [layers, slots, heads, OBSERVATION_WINDOW, head_dim]; for an evictor that `accumulates` (H2O) also
    the fp32 attention each entry received since it entered, [layers, slots, kv_heads, capacity] (`received`, else
    None), compacted with the entries. Rows are ids mapped to slots, so `adopt` moves no data; a fork copies its
    parent's entries, ring, received attention and counters. The pools grow when rows
    (by doubling) or an append do not fit: capacity defaults to B' + `max_append`, so only an append
    longer than `max_append` reallocates. `evictor` is a policy (`evictors.base.Evictor`) or the name of one in
    `evictors.registry.EVICTORS` (its default settings); `--evictor none` keeps a full cache (`FullCache`) instead.
    """

    @torch.inference_mode(False)  # the pools are written outside inference mode too (forks)
    def __init__(
        self,
        n_layers: int,
        n_heads: int,
        n_kv_heads: int,
        head_dim: int,
        *,
        budget: int,
        evictor: Evictor | str = "rkv",
        buffer: int = BUFFER,
        max_append: int = 512,
        rows: int = 16,
        capacity: int | None = None,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
    ) -> None:
        if not isinstance(evictor, Evictor) and evictor not in EVICTORS:
            raise ValueError(f"unknown evictor {evictor!r} for a bounded cache; choose one of {tuple(EVICTORS)}")
        if budget < MIN_BUDGET:
            raise ValueError(f"budget {budget} is below the minimum {MIN_BUDGET}")
        self.evictor, self.budget, self.trigger = evictor_named(evictor), budget, budget + buffer
        cap = capacity or self.trigger + max_append
        self.k = torch.zeros(n_layers, rows, n_kv_heads, cap, head_dim, dtype=dtype, device=device)
        self.v = torch.zeros_like(self.k)
        self.q = torch.zeros(n_layers, rows, n_heads, OBSERVATION_WINDOW, head_dim, dtype=dtype, device=device)
        self.layers = layer_views(self.k, self.v, self.q)  # each layer's (k, v, q) pools
        self.received = (torch.zeros(n_layers, rows, n_kv_heads, cap, dtype=torch.float32, device=device)
                         if self.evictor.accumulates else None)
        self.layer_budgets = self.evictor.layer_budgets(n_layers, budget, self.trigger)
        # Each row id's pool slot, entries held, tokens appended (the next RoPE position) and the largest number
        # of entries it (and the rows it was forked from) held; ids below next_id, those in free_ids unused.
        self.row_slot = np.zeros(rows, np.int64)
        self.row_physical = np.zeros(rows, np.int64)
        self.row_logical = np.zeros(rows, np.int64)
        self.row_peak = np.zeros(rows, np.int64)
        self.row_held = np.zeros((rows, n_layers, n_kv_heads), np.int64)
        self.row_base = np.zeros(rows, np.int64)
        self.free_slots = list(range(rows - 1, -1, -1))
        self.free_ids: list[int] = []
        self.next_id = 0
        self.generation = 0  # times the pools were reallocated (what reads them in place, CUDA graphs, must know)
        self.fwd: _BoundedForward | None = None

    @classmethod
    def for_model(cls, model: torch.nn.Module, budget: int, evictor: Evictor | str = "rkv", **kw) -> "BoundedCache":
        """A cache for `model` (a `Transformer`), in its dtype and on its device."""
        a = model.args
        p = next(model.parameters())
        kw.setdefault("dtype", p.dtype)
        kw.setdefault("device", p.device)
        return cls(a.n_layers, a.n_heads, a.n_kv_heads, a.head_dim, budget=budget, evictor=evictor, **kw)

    @property
    def capacity(self) -> int:
        return self.k.shape[3]

    def physical_length(self, row: int) -> int:
        """Entries the row holds now."""
        return int(self.row_physical[row])

    def peak_length(self, row: int) -> int:
        """Largest physical length the row held, counting the history it inherited through forks."""
        return int(self.row_peak[row])

    # -- rows ---------------------------------------------------------------------------------------
    def create(self) -> int:
        if not self.free_slots:
            self._grow(rows=2 * self.k.shape[1])
        row = self.free_ids.pop() if self.free_ids else self._new_id()
        self.row_slot[row] = self.free_slots.pop()
        self.row_physical[row] = self.row_logical[row] = self.row_peak[row] = self.row_base[row] = 0
        self.row_held[row] = 0
        return row

    def fork(self, row: int, n: int) -> list[int]:
        return self.fork_each([row], n)

    def fork_each(self, rows: Sequence[int], n: int) -> list[int]:
        children = [self.create() for _ in range(len(rows) * n)]
        if children:
            parents = np.repeat(np.asarray(rows, np.int64), n)
            slots = upload_all({"dst": self.row_slot[children], "src": self.row_slot[parents]}, self.k.device)
            dst, src = slots["dst"], slots["src"]
            p = int(self.row_physical[parents].max())  # past a parent's entries: values its children never read
            # Indexing the sources copies them out first: an indexed write may not read a view of the pool it writes.
            self.k[:, dst, :, :p] = self.k[:, src, :, :p]
            self.v[:, dst, :, :p] = self.v[:, src, :, :p]
            self.q[:, dst] = self.q[:, src]
            if self.received is not None:
                self.received[:, dst, :, :p] = self.received[:, src, :, :p]
            for lengths in self._row_state()[1:]:
                lengths[children] = lengths[parents]
        return children

    def adopt(self, row: int, child: int) -> None:
        self.free_slots.append(int(self.row_slot[row]))
        for state in self._row_state():
            state[row] = state[child]
        self.free_ids.append(child)

    def release(self, rows: Iterable[int]) -> None:
        rows = list(rows)
        self.free_slots += self.row_slot[rows].tolist()
        self.free_ids += rows

    def length(self, row: int) -> int:
        return int(self.row_logical[row])

    def slot(self, row: int) -> int:
        """The pool slot holding the row's entries."""
        return int(self.row_slot[row])

    def reserve_slot(self) -> int:
        """One more slot, that no row will ever use (static decode steps write their padding rows there);
        the rows the cache was sized for still fit without a growth."""
        self._grow(rows=self.k.shape[1] + 1)
        return self.free_slots.pop(0)

    def advance(self, rows: Sequence[int]) -> None:
        """Count one token appended to each row outside `begin`/`end` (a static decode step), then compress as `end` does."""
        rows = np.asarray(rows, np.int64)
        self._appended(rows, 1)
        self.compress(rows[self.row_physical[rows] >= self.trigger])

    def _appended(self, rows: np.ndarray, n: np.ndarray | int) -> None:
        self.row_physical[rows] += n
        self.row_logical[rows] += n
        self.row_peak[rows] = np.maximum(self.row_peak[rows], self.row_physical[rows])

    def _new_id(self) -> int:
        self.next_id += 1
        if self.next_id > len(self.row_slot):
            for name in ("row_slot", "row_physical", "row_logical", "row_peak", "row_held", "row_base"):
                old = getattr(self, name)
                setattr(self, name, np.concatenate([old, np.zeros_like(old)]))
        return self.next_id - 1

    def _row_state(self) -> tuple[np.ndarray, ...]:
        """What the cache knows of each row id, its slot first."""
        return self.row_slot, self.row_physical, self.row_logical, self.row_peak, self.row_held, self.row_base

    @torch.inference_mode(False)  # likewise when growing inside a forward
    def _grow(self, rows: int | None = None, capacity: int | None = None) -> None:
        """Reallocate the pools with more slots and/or more capacity per slot, keeping the content."""
        n_layers, old_rows, h_kv, old_cap, d = self.k.shape
        rows, capacity = rows or old_rows, capacity or old_cap
        for name in ("k", "v"):
            old = getattr(self, name)
            new = old.new_zeros(n_layers, rows, h_kv, capacity, d)
            new[:, :old_rows, :, :old_cap] = old
            setattr(self, name, new)
        q = self.q.new_zeros(n_layers, rows, *self.q.shape[2:])
        q[:, :old_rows] = self.q
        self.q = q
        self.layers = layer_views(self.k, self.v, self.q)
        if self.received is not None:
            received = self.received.new_zeros(n_layers, rows, h_kv, capacity)
            received[:, :old_rows, :, :old_cap] = self.received
            self.received = received
        self.generation += 1
        self.free_slots = list(range(rows - 1, old_rows - 1, -1)) + self.free_slots

    # -- forward protocol ---------------------------------------------------------------------------
    def begin(self, rows: Sequence[int], n_new: Sequence[int]) -> torch.Tensor:
        rows = np.asarray(rows, np.int64)
        slots, physical, logical = self.row_slot[rows], self.row_physical[rows], self.row_logical[rows]
        new = np.asarray(n_new, np.int64)
        need = int((physical + new).max())
        if invariance.active(self.k):  # every row reads whole KEY_GRANULE blocks, whatever the others hold
            need = invariance.padded_keys(need)
        if need > self.capacity:  # just enough, rounded up to 64
            self._grow(capacity=-(-need // 64) * 64)
        t = np.arange(int(new.max()))
        valid = t[None, :] < new[:, None]
        row, step = np.nonzero(valid)
        # The host knows every row's lengths and slot: one copy to the device, which nothing here waits for.
        host = {"slots": slots, "kv_lengths": physical, "new_lengths": new, "write_slots": slots[row],
                "write_pos": physical[row] + step, "valid": np.flatnonzero(valid), "positions": logical[:, None] + t}
        if len(t) > 1:  # several tokens a row: the ring's new place (one token: the ring shifts by one, `store_token`)
            host["window"] = (new[:, None] + np.arange(OBSERVATION_WINDOW))[:, None, :, None]
        if self.evictor.allocates:
            host |= {"held": self.row_held[rows], "base": self.row_base[rows]}
        dev = upload_all(host, self.k.device)
        consecutive = bool((slots == slots[0] + np.arange(len(slots))).all())
        self.fwd = _BoundedForward(
            rows=rows,
            slots=slice(int(slots[0]), int(slots[0]) + len(slots)) if consecutive else dev["slots"],
            kv_lengths=dev["kv_lengths"],
            new_lengths=dev["new_lengths"],
            length=need,
            write_slots=dev["write_slots"],
            write_pos=dev["write_pos"],
            valid=dev["valid"],
            window=dev.get("window"),
            visible=Visibility(padded_visibility(dev["kv_lengths"], dev["new_lengths"], len(t), need)),
            held=dev.get("held"),
            base=dev.get("base"),
            in_place=self._in_place(dev) if len(t) == 1 else None,
        )
        self._appended(rows, new)
        return dev["positions"]

    def _in_place(self, dev: dict[str, torch.Tensor]) -> flex.SlotSteps | None:
        """A one-token forward's attention through FlexAttention (each row's slot read in place), where it serves and
        the evictor does not accumulate attention (H2O's reads the rows' keys gathered)."""
        serves = self.received is None and flex.serves(self.k)
        tiles = flex.span_tiles(self.trigger, self.capacity) if serves else None
        if tiles is None:
            return None
        return flex.SlotSteps(self.k.shape[1], dev["slots"], dev["kv_lengths"], tiles,
                              self.q.shape[2] // self.k.shape[2], dev.get("base"))

    def store_token(self, layer: int, slots: torch.Tensor, positions: torch.Tensor, q: torch.Tensor,
                    k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One new token per row: its k/v [R, Hkv, 1, D] at physical `positions` of pool `slots`, and its
        query [R, Hq, 1, D] pushed into the row's window ring (the oldest drops out). The one-token step of
        both decodes, the dynamic one here and the static (CUDA-graph) one in `graphs`. Returns the layer's K and V
        pools, which its attention reads."""
        kp, vp, qp = self.layers[layer]
        kp[slots, :, positions] = k[:, :, 0]
        vp[slots, :, positions] = v[:, :, 0]
        qp[slots] = torch.cat([qp[slots][:, :, 1:], q], dim=2)
        return kp, vp

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        f = self.fwd
        kp, vp, qp = self.layers[layer]
        if q.shape[2] == 1:  # every row appends one token (appends are never empty)
            self.store_token(layer, f.write_slots, f.kv_lengths, q, k, v)
        else:
            kp[f.write_slots, :, f.write_pos] = k.transpose(1, 2).flatten(0, 1).index_select(0, f.valid)
            vp[f.write_slots, :, f.write_pos] = v.transpose(1, 2).flatten(0, 1).index_select(0, f.valid)
            # the ring keeps the last OBSERVATION_WINDOW queries: positions n .. n+W-1 of (ring ++ new queries)
            joined = torch.cat([qp[f.slots], q], dim=2)
            qp[f.slots] = joined.gather(2, f.window.expand(-1, q.shape[1], -1, q.shape[3]))
        if f.in_place is not None:
            return f.in_place.attend(q, kp, vp, None if f.held is None else f.held[:, layer])
        keys = kp[f.slots, :, : f.length]
        if self.received is not None:
            real = torch.arange(q.shape[2], device=q.device) < f.new_lengths[:, None]
            self.receive(layer, f.slots, q, keys, f.visible.visible, f.kv_lengths, real)
        visible = f.visible
        if f.held is not None:
            visible = f.visible.visible[:, None] & hole_free(f.held[:, layer], f.base, f.length)
        return attend_masked(q, keys, vp[f.slots, :, : f.length], visible)

    def receive(self, layer: int, slots: torch.Tensor | slice, q: torch.Tensor, keys: torch.Tensor,
                visible: torch.Tensor, cached: torch.Tensor, real: torch.Tensor | None = None) -> None:
        """H2O's accumulation: add the attention the new queries q [R, Hq, T, D] pay the rows' keys [R, Hkv, L, D]
        (`evictors.h2o.received_attention`) to the rows' `received`; each row's entries from `cached` [R] on (its new
        ones, and stale values past them) start from zero. Both decodes call it, the dynamic one here and the
        static one in `graphs`."""
        pool, length = self.received[layer], keys.shape[2]
        old = (torch.arange(length, device=keys.device) < cached[:, None])[:, None]  # [R, 1, L]
        before = torch.where(old, pool[slots, :, :length], 0.0)
        pool[slots, :, :length] = before + received_attention(q, keys, visible, real)

    def end(self) -> None:
        rows, self.fwd = self.fwd.rows, None
        self.compress(rows[self.row_physical[rows] >= self.trigger])

    def compress(self, rows: Sequence[int]) -> None:
        """Compress each row to `budget` entries per layer and KV head (`compression.compress`)."""
        compress(self, np.asarray(rows, np.int64))
