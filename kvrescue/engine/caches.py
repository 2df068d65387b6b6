"""KV caches: the interface the decoder's attention talks to, and the full-context shared-prefix cache.

A cache holds rows of K/V for many sequences in one batch. The controller creates, forks, adopts and
releases rows; the model drives a forward through `begin` / `attend` (once per layer) / `end`.
"""

from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence

import numpy as np
import torch

import kvrescue.engine.invariance as invariance
from kvrescue.engine.attention import (FLASH_BLOCK, ROWS_PADDING, Visibility, attend_masked, attend_paged,
                                       flash_reads, merge_partials, padded_visibility, paged_keys, use_flash)
from kvrescue.engine.block_table import BlockTable
from kvrescue.engine.paged_forward import (Groups, PagedForward, SharedPrefixes, cascading, filled_blocks,
                                           forward_arrays, slot_copies)
from kvrescue.engine.transfer import upload_all
from kvrescue.shapes import GROUP_CASCADE_FROM, CascadeCost, cascade_cost_on, token_kv_bytes


def layer_views(*pools: torch.Tensor) -> list[tuple[torch.Tensor, ...]]:
    """Each layer's views of `pools` (tensors [layers, ...]), made once an allocation: a forward's layers then read
    their pools without dispatching an op each (as vLLM binds each attention layer its cache). Indexed one by one:
    the views of `unbind` may not be written in place where autograd records."""
    return [tuple(pool[layer] for pool in pools) for layer in range(pools[0].shape[0])]


class KVCache(ABC):
    """Rows of K/V for many sequences in one batch; the decoder's attention reads and writes it."""

    @abstractmethod
    def create(self) -> int:
        """A new empty row."""

    @abstractmethod
    def fork(self, row: int, n: int) -> list[int]:
        """n children that see row's content; a child never changes its parent (nor the parent a child)."""

    def fork_each(self, rows: Sequence[int], n: int) -> list[int]:
        """n children of each of `rows`, row after row: `fork` of each row (a cache may do it in one pass)."""
        return [child for row in rows for child in self.fork(row, n)]

    @abstractmethod
    def adopt(self, row: int, child: int) -> None:
        """Row takes child's content (the committed step); child is released."""

    @abstractmethod
    def release(self, rows: Iterable[int]) -> None:
        """Free rows and whatever only they referenced."""

    @abstractmethod
    def length(self, row: int) -> int:
        """Logical length: tokens appended so far, which is also the next token's RoPE position."""

    @abstractmethod
    def peak_length(self, row: int) -> int:
        """Largest physical length (entries held) the row reached, counting what it inherited through forks."""

    @abstractmethod
    def begin(self, rows: Sequence[int], n_new: Sequence[int]) -> torch.Tensor:
        """Start a forward appending n_new[i] tokens to rows[i]; returns their logical positions [R, T].

        T = max(n_new); shorter rows are right padded (positions past n_new are meaningless).
        """

    @abstractmethod
    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Store the valid new k/v of `layer` and attend: q [R,Hq,T,D], k/v [R,Hkv,T,D] post-RoPE.

        Each new token attends to its row's cached keys and causally to the row's new keys.
        Returns [R, Hq, T, D].
        """

    @abstractmethod
    def end(self) -> None:
        """The forward is finished (an evicting cache compresses rows here)."""


TORCH_BLOCK = 16  # tokens per block of a full cache on the torch attention path


def block_size_for(x: torch.Tensor) -> int:
    """Tokens per block of a full cache holding tensors like `x`: FLASH_BLOCK when flash-attn serves them
    (its paged cache needs it), else TORCH_BLOCK."""
    return FLASH_BLOCK if use_flash(x) else TORCH_BLOCK


class FullCache(KVCache):
    """Full-context cache in fixed-size blocks with reference counts (prefix sharing, nano-vllm style).

    A fork shares all of its parent's blocks; the first write into a shared, partly filled last block
    copies that block (copy-on-write), so memory per problem is O(context + candidates x step length).
    K/V live in two preallocated pools [layers, blocks, block_size, kv_heads, head_dim]; the rows' blocks,
    lengths and reference counts are host arrays (`block_table.BlockTable`): the host decides where every block
    lies, so a forward's metadata is computed on the host and sent in one copy that does not wait for the device.

    Attention reads the blocks in place through the block table (`attend_paged`: flash-attn on a GPU, else
    FlexAttention on CUDA where it serves, `flex.serves`, else torch), each row only its own blocks. With cascade,
    rows of a forward that share their first blocks (a problem's candidates, forked from its committed prefix) form a
    group: the group's queries attend to the shared blocks in one pass that reads them once, each row to its remaining
    blocks in another, and the two results are merged exactly by their log-sum-exp. A forward whose rows hold no keys
    yet (a first prefill) attends over its new keys alone where flash-attn does not read the pools (no paged read), its
    mask laid out once.
    `cascade`: the cost model a forward cascades by, when it says cascade is faster (`shapes.CascadeCost`;
    `shapes.ALWAYS_CASCADE`: whenever rows share a block; None: never, even with batch invariance on; "device": the
    device kind's, `shapes.cascade_cost_on`); with batch invariance on, each group cascades alone when its rows would
    re-read `group_cascade_from`.
    `rows_padding`: on the torch path, rows are read whole, padded to the longest, when that reads at most this many
    times the blocks of the chunks (0: always in chunks; inf: always whole; off a CPU only where `paged_layout` allows).
    """

    def __init__(
        self,
        n_layers: int,
        n_kv_heads: int,
        head_dim: int,
        num_blocks: int,
        *,
        max_rows: int = 1024,
        max_row_tokens: int = 8192,
        block_size: int = 16,
        cascade: CascadeCost | None | str = "device",
        group_cascade_from: int = GROUP_CASCADE_FROM,
        rows_padding: float = ROWS_PADDING,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
    ) -> None:
        self.block_size = block_size
        self.cascade = cascade_cost_on(torch.device(device).type == "cuda") if cascade == "device" else cascade
        self.group_cascade_from = group_cascade_from
        self.rows_padding = rows_padding
        self._allocate(torch.zeros(n_layers, num_blocks, block_size, n_kv_heads, head_dim, dtype=dtype, device=device))
        self.block_table = BlockTable(num_blocks, block_size, max_rows, max_row_tokens)
        self.fwd: PagedForward | None = None
        self.reserved: dict[int, tuple[int, int]] = {}  # row -> (its length before, tokens) that `reserve` made room for

    @classmethod
    def for_model(cls, model: torch.nn.Module, max_tokens: int, **kw) -> "FullCache":
        """A cache for `model` (a `Decoder` owner) with room for `max_tokens` tokens in all rows together."""
        a = model.args
        p = next(model.parameters())
        block_size = kw.pop("block_size", block_size_for(p))
        kw.setdefault("dtype", p.dtype)
        kw.setdefault("device", p.device)
        return cls(a.n_layers, a.n_kv_heads, a.head_dim, -(-max_tokens // block_size), block_size=block_size, **kw)

    # -- rows ---------------------------------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return self.block_table.num_blocks

    @property
    def free_rows(self) -> list[int]:
        """Row ids not in use."""
        return self.block_table.free_rows

    def create(self) -> int:
        return self.block_table.create()

    def fork(self, row: int, n: int) -> list[int]:
        return self.block_table.fork_each([row], n)

    def fork_each(self, rows: Sequence[int], n: int) -> list[int]:
        return self.block_table.fork_each(rows, n)

    def adopt(self, row: int, child: int) -> None:
        self.block_table.adopt(row, child)

    def release(self, rows: Iterable[int]) -> None:
        self.block_table.release(rows)

    def length(self, row: int) -> int:
        return int(self.block_table.lengths[row])

    def peak_length(self, row: int) -> int:
        return self.length(row)  # a full cache never shrinks a row

    def blocks(self, row: int) -> list[int]:
        """The row's blocks, in order: its token i lies in blocks(row)[i // block_size]."""
        return self.block_table.blocks(row)

    def blocks_in_use(self) -> int:
        """Physical blocks referenced by at least one row (or reserved)."""
        return self.block_table.blocks_in_use()

    # -- forward protocol ---------------------------------------------------------------------------
    def reserve(self, rows: Sequence[int], n_new: Sequence[int]) -> None:
        """Room for n_new[i] tokens of rows[i] that the next forward appends (with these rows among its own), made
        now: forks made in between hold them too, and append their own tokens in that same forward (a PRM's
        candidates, forked from the prefixes the forward feeds). Such a fork's copy of its parent's partly filled
        last block is made in each layer once the layer's new K/V are stored."""
        rows_np, n_np = np.asarray(rows, np.int64), np.asarray(n_new, np.int64)
        before = self.block_table.lengths[rows_np].copy()
        cow_src, cow_dst = self.block_table.append(rows_np, n_np)
        if len(cow_src):
            dev = upload_all({"src": cow_src, "dst": cow_dst}, self.k.device)
            self._copy_blocks(dev["src"], dev["dst"])
        self.reserved.update(zip(rows_np.tolist(), zip(before.tolist(), n_np.tolist())))

    def begin(self, rows: Sequence[int], n_new: Sequence[int]) -> torch.Tensor:
        rows_np, n_np = np.asarray(rows, np.int64), np.asarray(n_new, np.int64)
        lengths = self.block_table.lengths[rows_np].copy()
        held = np.array([row in self.reserved for row in rows_np.tolist()], bool)
        for i in np.flatnonzero(held):
            lengths[i], reserved = self.reserved.pop(int(rows_np[i]))
            if reserved != n_np[i]:
                raise RuntimeError(f"FullCache: row {rows_np[i]} reserved {reserved} tokens, the forward appends {n_np[i]}")
        if self.reserved:
            raise RuntimeError(f"FullCache: rows {sorted(self.reserved)} reserved tokens the forward does not append")
        filled = filled_blocks(self.block_table, rows_np[held], lengths[held], n_np[held])
        cow_src, cow_dst = self.block_table.append(rows_np[~held], n_np[~held])
        T = int(n_np.max())
        groups = self._cascading(rows_np, lengths, T)
        # No row holds keys yet (not where flash-attn reads; batch invariance keeps the paged read): attention over the
        # new keys alone, which SDPA reads where they are, no paged layout of the rows.
        fresh = not lengths.any() and not invariance.on() and not flash_reads(self.k[0])
        host = forward_arrays(self.block_table, self.k[0], rows_np, lengths, n_np, groups, self.rows_padding, not fresh)
        if fresh:
            host["new_lengths"] = n_np
        later = np.isin(cow_src, filled)  # their sources are filled in this forward: copied layer by layer
        host["cow_src"], host["cow_dst"] = cow_src[~later], cow_dst[~later]
        if later.any():
            host["copy_from"], host["copy_to"] = slot_copies(self.block_table, rows_np[~held], lengths[~held],
                                                             cow_src[later], cow_dst[later])
        dev = upload_all(host, self.k.device)  # the forward's one copy; nothing here waits for the device
        self._copy_blocks(dev["cow_src"], dev["cow_dst"])
        pick = lambda prefix: {k[len(prefix):]: v for k, v in dev.items() if k.startswith(prefix)}  # noqa: E731
        shared = None
        if groups is not None:
            members = dev["members"]
            shared = SharedPrefixes(paged_keys(self.k[0], pick("shared."), members.shape[1] * T, causal=False),
                                    members, dev["grouped_rows"], dev["grouped_slots"])
        copies = (dev["copy_from"], dev["copy_to"]) if "copy_from" in dev else None
        own = None if fresh else paged_keys(self.k[0], pick("own."), T, causal=True)
        self.fwd = PagedForward(own, dev["slots"], dev.get("valid"), shared, copies)
        if fresh:
            new = dev["new_lengths"]
            self.fwd.fresh = Visibility(padded_visibility(torch.zeros_like(new), new, T, T))
        return dev["positions"]

    def append_rows(self, rows: Sequence[int], n_new: np.ndarray) -> np.ndarray:
        """Make room for n_new[i] more tokens in rows[i] (a static forward, `graphs`), copying a shared last block
        first where the row writes into it; the rows' lengths before it (their first new token's positions)."""
        rows_np = np.asarray(rows, np.int64)
        lengths = self.block_table.lengths[rows_np]
        cow_src, cow_dst = self.block_table.append(rows_np, np.asarray(n_new, np.int64))
        if len(cow_src):
            dev = upload_all({"src": cow_src, "dst": cow_dst}, self.k.device)
            self._copy_blocks(dev["src"], dev["dst"])
        return lengths

    @torch.inference_mode(False)  # pools made outside inference mode, as in __init__
    def reserve_block(self) -> int:
        """One more block, that no row will ever hold (static decode steps write their padding rows there). Before
        any row holds a block: the pools are made again one block larger, the old ones dropped first (no copy, and
        never both at once)."""
        if self.blocks_in_use():
            raise RuntimeError("FullCache.reserve_block: rows hold blocks already")
        shape, dtype, device = list(self.k.shape), self.k.dtype, self.k.device
        shape[1] += 1
        self.k = self.v = self.layers = None
        self._allocate(torch.zeros(shape, dtype=dtype, device=device))
        return self.block_table.reserve()

    def _allocate(self, k: torch.Tensor) -> None:
        """Pools k (given) and v (zeros like it), and each layer's views of them: (k, v) [blocks, block_size, Hkv, D],
        then the same as slots [blocks * block_size, Hkv, D]."""
        self.k, self.v = k, torch.zeros_like(k)
        self.layers = layer_views(self.k, self.v, self.k.flatten(1, 2), self.v.flatten(1, 2))

    def _copy_blocks(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy the pools' blocks src[i] to dst[i] (device index tensors) in every layer."""
        if len(src):
            self.k[:, dst] = self.k[:, src]
            self.v[:, dst] = self.v[:, src]

    def _cascading(self, rows: np.ndarray, lengths: np.ndarray, tokens: int) -> Groups | None:
        """The groups of the forward's rows that cascade, by this cache's rule (`paged_forward.cascading`)."""
        token_bytes = token_kv_bytes(self.k.shape[3], self.k.shape[4], self.k.element_size())
        return cascading(self.block_table, rows, lengths, tokens, self.cascade, token_bytes, self.group_cascade_from)

    def store(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write the forward's valid new k/v [R, Hkv, T, D] of `layer` into their slots, then copy the slots of blocks
        filled in this forward to the forks' copies of them. Returns the layer's pools (`store_at`)."""
        pools = self.store_at(layer, self.fwd.slots, k, v, self.fwd.valid)
        if self.fwd.copies is not None:
            source, target = self.fwd.copies
            for flat in self.layers[layer][2:]:
                flat.index_copy_(0, target, flat.index_select(0, source))
        return pools

    def store_at(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 valid: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Write new k/v [R, Hkv, T, D] of `layer` (those at flat indices `valid` of the R x T, or all) into their
        flat pool slots (block * block_size + offset). The write of both decodes, the dynamic one and the static one
        in `graphs`. Returns the layer's pools [blocks, block_size, Hkv, D] (k, v), which its attention reads."""
        R, _, T, _ = k.shape
        heads_dim = self.k.shape[3:]
        kp, vp, k_slots, v_slots = self.layers[layer]
        for new, flat in zip((k, v), (k_slots, v_slots)):
            new = (new if T == 1 else new.transpose(1, 2)).reshape(R * T, *heads_dim)  # one token a row: [R, Hkv, D]
            if valid is not None:
                new = new.index_select(0, valid)
            flat.index_copy_(0, slots, new)
        return kp, vp

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        kp, vp = self.store(layer, k, v)
        f = self.fwd
        if f.fresh is not None:  # nothing cached: causal attention over the new keys, no paged read
            return attend_masked(q, k, v, f.fresh)
        _, Hq, T, D = q.shape
        out, lse = attend_paged(q, kp, vp, f.own)
        s = f.shared
        if s is None:
            return out
        G, n = s.members.shape
        # Each group's rows' queries, side by side, attend to the group's shared blocks in one pass.
        grouped = q[s.members].transpose(1, 2).reshape(G, Hq, n * T, D)
        shared_out, shared_lse = attend_paged(grouped, kp, vp, s.keys)
        shared_out = shared_out.view(G, Hq, n, T, D).transpose(1, 2).reshape(G * n, Hq, T, D)[s.slots]
        shared_lse = shared_lse.view(G, Hq, n, T).transpose(1, 2).reshape(G * n, Hq, T)[s.slots]
        out[s.rows] = merge_partials(out[s.rows], lse[s.rows], shared_out, shared_lse)
        return out

    def end(self) -> None:
        self.fwd = None
