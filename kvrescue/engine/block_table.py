"""The full cache's host side (nano-vllm's block manager): each row's blocks, lengths, reference counts,
copy-on-write and the free lists, in numpy. It never touches a tensor: `FullCache` holds the device pools and does
the copies it is told to."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np


def ranks(sizes: np.ndarray) -> np.ndarray:
    """Each element's index within its run, for consecutive runs of the given sizes: [2, 3] -> [0, 1, 0, 1, 2]."""
    return np.arange(int(sizes.sum())) - np.repeat(np.cumsum(sizes) - sizes, sizes)


class BlockTable:
    """Rows of fixed-size blocks with reference counts (prefix sharing). A fork shares all of its parent's blocks;
    the first write into a shared, partly filled last block copies that block (copy-on-write). Each row has a row
    of a preallocated array [max_rows, max_row_tokens / block_size] (`table`): the host decides where every block
    lies."""

    def __init__(self, num_blocks: int, block_size: int, max_rows: int, max_row_tokens: int) -> None:
        self.num_blocks, self.block_size = num_blocks, block_size
        self.table = np.zeros((max_rows, -(-max_row_tokens // block_size)), np.int64)
        self.lengths = np.zeros(max_rows, np.int64)   # each row's tokens
        self.n_blocks = np.zeros(max_rows, np.int64)  # each row's blocks: table[row, :n_blocks[row]]
        self.refs = np.zeros(num_blocks, np.int64)
        self.free_blocks = np.arange(num_blocks - 1, -1, -1)  # a stack: its first n_free entries are free
        self.n_free = num_blocks
        self.free_rows = list(range(max_rows - 1, -1, -1))

    # -- rows ---------------------------------------------------------------------------------------
    def create(self) -> int:
        """A new empty row."""
        if not self.free_rows:
            raise RuntimeError(f"FullCache: all {self.table.shape[0]} rows in use")
        row = self.free_rows.pop()
        self.lengths[row] = self.n_blocks[row] = 0
        return row

    def fork_each(self, rows: Sequence[int], n: int) -> list[int]:
        """n children of each of `rows`, row after row, each sharing all of its parent's blocks."""
        children = [self.create() for _ in range(len(rows) * n)]
        parents = np.repeat(np.asarray(rows, np.int64), n)
        held = self.n_blocks[parents]
        width = int(held.max(initial=0))
        blocks = self.table[parents, :width]
        self.table[children, :width] = blocks  # past a child's own blocks: ids it never reads
        self.lengths[children], self.n_blocks[children] = self.lengths[parents], held
        shared, times = np.unique(blocks[np.arange(width) < held[:, None]], return_counts=True)
        self.refs[shared] += times
        return children

    def adopt(self, row: int, child: int) -> None:
        """Row takes child's blocks; child is released."""
        self._drop_rows([row])
        nb = self.n_blocks[child]
        self.table[row, :nb] = self.table[child, :nb]
        self.lengths[row], self.n_blocks[row] = self.lengths[child], nb
        self.free_rows.append(child)

    def release(self, rows: Iterable[int]) -> None:
        """Free rows and the blocks only they held."""
        rows = list(rows)
        self._drop_rows(rows)
        self.free_rows += rows

    def blocks(self, row: int) -> list[int]:
        """The row's blocks, in order: its token i lies in blocks(row)[i // block_size]."""
        return self.table[row, : self.n_blocks[row]].tolist()

    def blocks_in_use(self) -> int:
        """Physical blocks referenced by at least one row (or reserved)."""
        return self.num_blocks - self.n_free

    def reserve(self) -> int:
        """One more block, that no row will ever hold (held once, forever)."""
        self.refs = np.append(self.refs, 1)
        self.free_blocks = np.append(self.free_blocks, 0)
        self.num_blocks += 1
        return self.num_blocks - 1

    # -- appends ------------------------------------------------------------------------------------
    def append(self, rows: np.ndarray, n_new: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Blocks for n_new[i] more tokens of rows[i] (a partly filled last block that other rows hold is copied
        first) and the lengths; the blocks the pools must copy (sources, destinations)."""
        bs = self.block_size
        lengths, n_blocks = self.lengths[rows], self.n_blocks[rows]
        too_long = np.flatnonzero(lengths + n_new > self.table.shape[1] * bs)
        if len(too_long):
            raise RuntimeError(f"FullCache: row {rows[too_long[0]]} would exceed max_row_tokens "
                               f"({self.table.shape[1] * bs})")
        copies, cow_src = self._copies_on_write(rows, lengths, n_blocks, n_new)
        grow = -(-(lengths + n_new) // bs) - n_blocks
        new = self.new_blocks(len(copies) + int(grow.sum()))
        cow_dst, new = new[: len(copies)], new[len(copies):]
        np.subtract.at(self.refs, cow_src, 1)
        self.table[rows[copies], n_blocks[copies] - 1] = cow_dst
        which = np.repeat(np.arange(len(rows)), grow)
        self.table[rows[which], n_blocks[which] + ranks(grow)] = new
        self.n_blocks[rows] += grow
        self.lengths[rows] += n_new
        return cow_src, cow_dst

    def new_blocks(self, n: int) -> np.ndarray:
        """n free blocks, each referenced once."""
        if n > self.n_free:
            raise RuntimeError(
                f"FullCache: out of blocks ({self.num_blocks} x {self.block_size} tokens); build it with more"
            )
        self.n_free -= n
        blocks = self.free_blocks[self.n_free: self.n_free + n][::-1].copy()
        self.refs[blocks] = 1
        return blocks

    def _copies_on_write(self, rows: np.ndarray, lengths: np.ndarray, n_blocks: np.ndarray,
                         n_new: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The rows (indices into `rows`) about to write into a partly filled last block that other rows hold, which
        must copy it first, and those blocks. Rows of the forward holding the same such block copy it in their
        order, except the last holder when no row outside them holds it."""
        at = np.flatnonzero((lengths % self.block_size != 0) & (n_new > 0))
        last = self.table[rows[at], n_blocks[at] - 1]
        order = np.argsort(last, kind="stable")
        starts = np.flatnonzero(np.r_[True, last[order][1:] != last[order][:-1]])
        before = np.empty(len(at), np.int64)  # rows of this forward holding the same block before this one
        before[order] = ranks(np.diff(np.r_[starts, len(at)]))
        copy = before < self.refs[last] - 1
        return at[copy], last[copy]

    def _drop_rows(self, rows: Sequence[int]) -> None:
        """Drop the rows' references to their blocks, freeing those no row holds any more."""
        rows_np = np.asarray(rows, np.int64)
        n_blocks = self.n_blocks[rows_np]
        held = self.table[rows_np, : int(n_blocks.max(initial=0))]
        held = held[np.arange(held.shape[1]) < n_blocks[:, None]]
        held, times = np.unique(held, return_counts=True)
        self.refs[held] -= times
        self._push_free(held[self.refs[held] == 0])
        self.n_blocks[rows_np] = 0

    def _push_free(self, blocks: np.ndarray) -> None:
        self.free_blocks[self.n_free: self.n_free + len(blocks)] = blocks
        self.n_free += len(blocks)
