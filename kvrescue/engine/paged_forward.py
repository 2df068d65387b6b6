"""A full cache forward's metadata, computed on the host from the block table: positions, the new tokens' slots,
the paged layouts each row's attention reads, and the groups of rows that share leading blocks (cascade)."""

from dataclasses import dataclass

import numpy as np
import torch

import kvrescue.engine.invariance as invariance
from kvrescue.engine.attention import PagedKeys, Visibility, paged_layout
from kvrescue.engine.block_table import BlockTable, ranks
from kvrescue.shapes import CascadeCost

# Outside batch invariance, a forward cascades when the device's cost model (shapes.CascadeCost) says its shared
# reads saved outweigh the extra pass and merge (docs/benchmarks.md, "Cascade's cost model").
# With batch invariance on, whether a row cascades must not depend on the rows beside it, so each group decides
# from its own rows: from GROUP_CASCADE_FROM (shapes.py) re-read, N = 8 over a 512-token prefix. On a CPU, whose
# invariant attention reads whole 512-key blocks, a cascading row reads one block more, which a shorter prefix does
# not repay (docs/benchmarks.md, "Cascade attention under `--deterministic` on a CPU").


@dataclass
class SharedPrefixes:
    """Groups of a forward's rows that share their first blocks: each group's queries attend to the shared
    blocks in one pass (cascade attention), which reads those blocks once for the whole group."""

    keys: PagedKeys  # each group's shared blocks (whole blocks, all cached)
    members: torch.Tensor  # [G, n] each group's rows (indices into the forward), padded with its first row
    rows: torch.Tensor  # [M] every grouped row (index into the forward)
    slots: torch.Tensor  # [M] its place in the groups' flattened members (group * n + member)


@dataclass
class Groups:
    """A forward's rows that share leading blocks, group after group (from `shared_prefixes`)."""

    rows: np.ndarray    # [M] the grouped rows (indices into the forward), each group's rows in forward order
    sizes: np.ndarray   # [G] rows per group
    shared: np.ndarray  # [G] full blocks all rows of the group hold in common

    def select(self, keep: np.ndarray) -> "Groups | None":
        """The groups where `keep` [G] (None: none)."""
        if not keep.any():
            return None
        return Groups(self.rows[np.repeat(keep, self.sizes)], self.sizes[keep], self.shared[keep])


@dataclass
class PagedForward:
    """Metadata of the forward in progress, computed once in `begin` and read by every layer."""

    own: PagedKeys | None  # each row's blocks past its group's shared prefix (all of them if ungrouped); None: fresh
    slots: torch.Tensor  # [N] flat slot (block * block_size + offset) of each valid new token
    valid: torch.Tensor | None  # [N] flat (row * T + t) index of each valid new token; None when all are
    shared: SharedPrefixes | None  # None without cascade or when no two rows share a block
    copies: tuple[torch.Tensor, torch.Tensor] | None = None  # flat slots copied (from, to) in each layer once it
    # is stored: a fork's copy of a block its parent fills in the same forward (`FullCache.reserve`)
    fresh: Visibility | None = None  # no row has cached keys (a first prefill, torch path): what each new token sees
    # of the new keys ([R, T, T], `padded_visibility`); the rows attend over their new k/v alone


def filled_blocks(block_table: BlockTable, rows: np.ndarray, lengths: np.ndarray, n_new: np.ndarray) -> np.ndarray:
    """The blocks that rows' next n_new tokens (after `lengths`) are written to."""
    bs, table = block_table.block_size, block_table.table
    return np.concatenate([table[r, a // bs: -(-(a + n) // bs)] for r, a, n in zip(rows, lengths, n_new)]
                          + [np.zeros(0, np.int64)])


def slot_copies(block_table: BlockTable, rows: np.ndarray, lengths: np.ndarray, src: np.ndarray,
                dst: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The flat slots to copy (from, to) for the block copies src[i] -> dst[i] of rows (with `lengths` before
    the forward) that copy a block filled in the same forward: the slots before the row's own first token."""
    bs = block_table.block_size
    at = {int(block_table.table[r, a // bs]): a % bs for r, a in zip(rows, lengths) if a % bs}
    offsets = [np.arange(at[int(d)]) for d in dst]
    return (np.concatenate([s * bs + o for s, o in zip(src, offsets)]),
            np.concatenate([d * bs + o for d, o in zip(dst, offsets)]))


def forward_arrays(block_table: BlockTable, k_pool: torch.Tensor, rows: np.ndarray, lengths: np.ndarray,
                   n_new: np.ndarray, groups: Groups | None, rows_padding: float,
                   paged: bool = True) -> dict[str, np.ndarray]:
    """A forward's metadata, on the host: positions, the valid new tokens' slots, and the paged layouts of
    each row's own blocks (unless not `paged`: its rows attend over their new keys alone) and of the groups' shared
    prefixes (in pools like `k_pool`, one layer's)."""
    bs, T = block_table.block_size, int(n_new.max())
    skipped = np.zeros(len(rows), np.int64)  # shared blocks each row reads through its group
    if groups is not None:
        skipped[groups.rows] = np.repeat(groups.shared, groups.sizes)
    table = block_table.table[rows, : int((-(-(lengths + n_new) // bs)).max())]
    positions = lengths[:, None] + np.arange(T)
    valid = np.arange(T)[None, :] < n_new[:, None]
    row, _ = np.nonzero(valid)
    pos = positions[valid]
    host = {"positions": positions, "slots": table[row, pos // bs] * bs + pos % bs}
    if n_new.min() < T:
        host["valid"] = np.flatnonzero(valid)
    if paged:  # own blocks cover the padded queries' keys too (cached + T): a paged kernel may read that far
        own = skipped[:, None] + np.arange(int((-(-(lengths + T) // bs) - skipped).max()))
        own_table = np.take_along_axis(table, np.minimum(own, table.shape[1] - 1), 1)
        own_layout = paged_layout(k_pool, own_table, lengths - skipped * bs, T, True, rows_padding, groups is not None)
        host.update(("own." + k, v) for k, v in own_layout.items())
    if groups is not None:
        n = int(groups.sizes.max())
        starts = np.cumsum(groups.sizes) - groups.sizes
        member = ranks(groups.sizes)  # index within its group
        group = np.repeat(np.arange(len(groups.sizes)), groups.sizes)
        members = np.repeat(groups.rows[starts], n).reshape(-1, n)  # padded with each group's first row
        members[group, member] = groups.rows
        layout = paged_layout(k_pool, block_table.table[rows[groups.rows[starts]], : int(groups.shared.max())],
                              groups.shared * bs, n * T, False, rows_padding, merged=True)
        host.update(("shared." + k, v) for k, v in layout.items())
        host["members"] = members
        host["grouped_rows"] = groups.rows
        host["grouped_slots"] = group * n + member
    return host


def cascading(block_table: BlockTable, rows: np.ndarray, lengths: np.ndarray, tokens: int, cost: CascadeCost | None,
              token_bytes: int, group_cascade_from: int) -> Groups | None:
    """The groups of the forward's rows (`shared_prefixes`) that read their shared blocks in a pass of their
    own: all of them when `cost` says cascade pays for the shared tokens they would otherwise re-read (of
    `token_bytes` a layer) and their queries (`tokens` new ones a row), or with batch invariance on, each one whose
    own rows would re-read `group_cascade_from` (so that what a row computes depends on its siblings alone, a
    problem's candidates, never on the other rows of the forward). None: no cascade (`cost` None: never)."""
    groups = None if cost is None else shared_prefixes(block_table, rows, lengths)
    if groups is None:
        return None
    re_read = groups.shared * block_table.block_size * (groups.sizes - 1)
    if invariance.on():
        return groups.select(re_read >= group_cascade_from)
    return groups if cost.pays(int(re_read.sum()) * token_bytes, int(groups.sizes.sum()) * tokens) else None


def shared_prefixes(block_table: BlockTable, rows: np.ndarray, lengths: np.ndarray) -> Groups | None:
    """Groups of the forward's rows (indices into `rows`) holding the same first block, in the order of their
    first rows, each with the number of full cached blocks all its rows share, read from the host block
    table (None: no group). A row's block list only changes at its end, so rows holding the same block at
    index j hold the same blocks before it: the shared blocks are the leading run of equal table columns."""
    bs = block_table.block_size
    eligible = np.flatnonzero(lengths >= bs)
    first = block_table.table[rows[eligible], 0]
    order = np.argsort(first, kind="stable")  # by first block, each group's rows in forward order
    grouped, first = eligible[order], first[order]
    starts = np.flatnonzero(np.r_[True, first[1:] != first[:-1]])
    sizes = np.diff(np.r_[starts, len(grouped)])
    keep = sizes > 1
    if not keep.any():
        return None
    by_row = np.argsort(grouped[starts[keep]])  # groups in the order of their first rows
    starts, sizes = starts[keep][by_row], sizes[keep][by_row]
    members = grouped[np.repeat(starts, sizes) + ranks(sizes)]
    heads = np.cumsum(sizes) - sizes  # each group's first place in `members`
    limit = np.minimum.reduceat(lengths[members], heads) // bs
    width = int(limit.max())
    blocks = block_table.table[rows[members], :width]
    leader = np.repeat(blocks[heads], sizes, axis=0)
    parted = np.logical_or.reduceat(blocks != leader, heads, axis=0)
    parted |= np.arange(width) >= limit[:, None]
    shared = np.where(parted.any(1), parted.argmax(1), width)
    return Groups(members, sizes, shared)
