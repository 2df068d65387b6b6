"""The full cache's host block table alone: no tensors, only where blocks lie and who holds them."""

import numpy as np

from kvrescue.engine.block_table import BlockTable, ranks


def test_ranks_count_within_runs():
    assert ranks(np.array([2, 3, 1])).tolist() == [0, 1, 0, 1, 2, 0]


def test_forks_share_blocks_and_the_first_writes_into_a_shared_partial_block_copy_it_but_the_last_holder():
    table = BlockTable(num_blocks=16, block_size=4, max_rows=8, max_row_tokens=32)
    parent = table.create()
    src, dst = table.append(np.array([parent]), np.array([6]))  # 6 tokens: 2 blocks, nothing to copy
    assert len(src) == len(dst) == 0
    children = table.fork_each([parent], 2)
    assert [table.blocks(c) for c in children] == [table.blocks(parent)] * 2
    assert table.blocks_in_use() == 2
    table.release([parent])
    src, dst = table.append(np.array(children), np.array([1, 1]))
    # Two rows hold the partly filled block: the first copies it, the second (its last holder) writes in place.
    assert src.tolist() == [table.blocks(children[1])[1]] and dst.tolist() == [table.blocks(children[0])[1]]
    assert table.blocks_in_use() == 3 and table.lengths[children].tolist() == [7, 7]
    table.release(children)
    assert table.blocks_in_use() == 0 and len(table.free_rows) == 8


def test_a_reserved_block_is_never_handed_out():
    table = BlockTable(num_blocks=2, block_size=4, max_rows=2, max_row_tokens=8)
    scratch = table.reserve()
    row = table.create()
    table.append(np.array([row]), np.array([8]))
    assert scratch not in table.blocks(row) and table.blocks_in_use() == 3
