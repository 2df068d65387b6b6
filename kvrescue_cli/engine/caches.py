"""KV caches: the interface the decoder's attention talks to, and the full-context shared-prefix cache.

A cache holds rows of K/V for many sequences in one batch. The controller creates, forks, adopts and
releases rows; the model drives a forward through `begin` / `attend` (once per layer) / `end`.
"""

from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch

from kvrescue_cli.engine.attention import attend_padded


class KVCache(ABC):
    """Rows of K/V for many sequences in one batch; the decoder's attention reads and writes it."""

    @abstractmethod
    def create(self) -> int:
        """A new empty row."""

    @abstractmethod
    def fork(self, row: int, n: int) -> list[int]:
        """n children that see row's content; a child never changes its parent (nor the parent a child)."""

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


@dataclass
class _Forward:
    """Metadata of the forward in progress, computed once in `begin` and read by every layer."""

    blocks: torch.Tensor  # [R * nb] block ids covering every row's cached + new tokens, row by row
    kv_lengths: torch.Tensor  # [R] cached tokens before this forward
    new_lengths: torch.Tensor  # [R]
    slots: torch.Tensor  # [N] flat slot (block * block_size + offset) of each valid new token
    valid: torch.Tensor | None  # [N] flat (row * T + t) index of each valid new token; None when all are


@dataclass
class _Row:
    blocks: list[int] = field(default_factory=list)
    length: int = 0


class FullCache(KVCache):
    """Full-context cache in fixed-size blocks with reference counts (prefix sharing, nano-vllm style).

    A fork shares all of its parent's blocks; the first write into a shared, partly filled last block
    copies that block (copy-on-write), so memory per problem is O(context + candidates x step length).
    K/V live in two preallocated pools [layers, blocks, block_size, kv_heads, head_dim]; each row has
    a block table row in a preallocated [max_rows, max_row_tokens / block_size] tensor.
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
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
    ) -> None:
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.k = torch.zeros(n_layers, num_blocks, block_size, n_kv_heads, head_dim, dtype=dtype, device=device)
        self.v = torch.zeros_like(self.k)
        self.table = torch.zeros(max_rows, -(-max_row_tokens // block_size), dtype=torch.long, device=device)
        self.refs = [0] * num_blocks
        self.free_blocks = list(range(num_blocks - 1, -1, -1))
        self.free_rows = list(range(max_rows - 1, -1, -1))
        self.rows: dict[int, _Row] = {}
        self.fwd: _Forward | None = None

    @classmethod
    def for_model(cls, model: torch.nn.Module, max_tokens: int, **kw) -> "FullCache":
        """A cache for `model` (a `Decoder` owner) with room for `max_tokens` tokens in all rows together."""
        a = model.args
        block_size = kw.pop("block_size", 16)
        p = next(model.parameters())
        kw.setdefault("dtype", p.dtype)
        kw.setdefault("device", p.device)
        return cls(a.n_layers, a.n_kv_heads, a.head_dim, -(-max_tokens // block_size), block_size=block_size, **kw)

    # -- rows ---------------------------------------------------------------------------------------
    def create(self) -> int:
        if not self.free_rows:
            raise RuntimeError(f"FullCache: all {self.table.shape[0]} rows in use")
        row = self.free_rows.pop()
        self.rows[row] = _Row()
        return row

    def fork(self, row: int, n: int) -> list[int]:
        parent = self.rows[row]
        children = []
        for _ in range(n):
            child = self.create()
            self.rows[child] = _Row(list(parent.blocks), parent.length)
            for b in parent.blocks:
                self.refs[b] += 1
            children.append(child)
        if children and parent.blocks:
            nb = len(parent.blocks)
            self.table[children, :nb] = self.table[row, :nb]
        return children

    def adopt(self, row: int, child: int) -> None:
        self._drop_blocks(self.rows[row].blocks)
        taken = self.rows.pop(child)
        self.rows[row] = taken
        if taken.blocks:
            self.table[row, : len(taken.blocks)] = self.table[child, : len(taken.blocks)]
        self.free_rows.append(child)

    def release(self, rows: Iterable[int]) -> None:
        for row in rows:
            self._drop_blocks(self.rows.pop(row).blocks)
            self.free_rows.append(row)

    def length(self, row: int) -> int:
        return self.rows[row].length

    def blocks_in_use(self) -> int:
        """Physical blocks referenced by at least one row."""
        return self.num_blocks - len(self.free_blocks)

    def _drop_blocks(self, blocks: list[int]) -> None:
        for b in blocks:
            self.refs[b] -= 1
            if self.refs[b] == 0:
                self.free_blocks.append(b)

    def _new_block(self) -> int:
        if not self.free_blocks:
            raise RuntimeError(
                f"FullCache: out of blocks ({self.num_blocks} x {self.block_size} tokens); build it with more"
            )
        b = self.free_blocks.pop()
        self.refs[b] = 1
        return b

    # -- forward protocol ---------------------------------------------------------------------------
    def begin(self, rows: Sequence[int], n_new: Sequence[int]) -> torch.Tensor:
        bs = self.block_size
        changed_rows, changed_idx, changed_blocks = [], [], []
        cow_src, cow_dst = [], []
        lengths = []
        for row, n in zip(rows, n_new):
            r = self.rows[row]
            lengths.append(r.length)
            if r.length % bs and n and self.refs[r.blocks[-1]] > 1:
                old, new = r.blocks[-1], self._new_block()
                self.refs[old] -= 1
                cow_src.append(old)
                cow_dst.append(new)
                r.blocks[-1] = new
                changed_rows.append(row)
                changed_idx.append(len(r.blocks) - 1)
                changed_blocks.append(new)
            if r.length + n > self.table.shape[1] * bs:
                raise RuntimeError(f"FullCache: row {row} would exceed max_row_tokens ({self.table.shape[1] * bs})")
            while len(r.blocks) * bs < r.length + n:
                changed_rows.append(row)
                changed_idx.append(len(r.blocks))
                r.blocks.append(self._new_block())
                changed_blocks.append(r.blocks[-1])
            r.length += n
        dev = self.table.device
        if cow_src:
            src, dst = torch.tensor(cow_src, device=dev), torch.tensor(cow_dst, device=dev)
            self.k[:, dst] = self.k[:, src]
            self.v[:, dst] = self.v[:, src]
        if changed_rows:
            self.table[torch.tensor(changed_rows, device=dev), torch.tensor(changed_idx, device=dev)] = (
                torch.tensor(changed_blocks, device=dev)
            )
        kv_lengths = torch.tensor(lengths, device=dev)
        new_lengths = torch.tensor(list(n_new), device=dev)
        T = max(n_new)
        nb = -(-max(l + n for l, n in zip(lengths, n_new)) // bs)
        table = self.table[torch.tensor(list(rows), device=dev), :nb]
        positions = kv_lengths[:, None] + torch.arange(T, device=dev)
        valid = torch.arange(T, device=dev)[None, :] < new_lengths[:, None]
        pos = positions[valid]
        slots = table[valid.nonzero()[:, 0], pos // bs] * bs + pos % bs
        flat_valid = None if min(n_new) == T else valid.flatten().nonzero()[:, 0]
        self.fwd = _Forward(table.flatten(), kv_lengths, new_lengths, slots, flat_valid)
        return positions

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        f = self.fwd
        R, T, heads_dim = q.shape[0], q.shape[2], self.k.shape[3:]
        for new, pool in ((k, self.k[layer]), (v, self.v[layer])):
            new = new.transpose(1, 2).reshape(R * T, *heads_dim)
            if f.valid is not None:
                new = new.index_select(0, f.valid)
            pool.view(-1, *heads_dim).index_copy_(0, f.slots, new)
        # index_select on the block axis is much cheaper than advanced indexing with the [R, nb] table.
        kr = self.k[layer].index_select(0, f.blocks).view(R, -1, *heads_dim).transpose(1, 2)
        vr = self.v[layer].index_select(0, f.blocks).view(R, -1, *heads_dim).transpose(1, 2)
        return attend_padded(q, kr, vr, f.kv_lengths, f.new_lengths)

    def end(self) -> None:
        self.fwd = None
