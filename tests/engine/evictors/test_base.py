"""The machinery every evictor shares: the top of the scores and the window kept, ties, budgets, rows, gathering."""

from __future__ import annotations

import pytest
import torch

from kvrescue.engine.evictors.base import gather_positions
from kvrescue.engine.evictors.registry import keep_positions
from tests.engine.evictors.loops import loop_rkv, random_inputs
from tests.oracles import rkv_keep, snapkv_keep, streaming_keep


def test_ties_go_to_the_earlier_position():
    # One-hot keys make every cosine exactly 0 or 1 and zero queries make importance uniform,
    # so whole groups of positions score exactly alike.
    length, d = 40, 4
    keys = torch.zeros(2, length, d)
    keys[0, torch.arange(length), torch.arange(length) % d] = 1.0
    keys[1, torch.arange(length), (torch.arange(length) // 10) % d] = 1.0
    queries = torch.zeros(4, 8, d)
    expected, _ = loop_rkv(keys, queries, 16)
    assert torch.equal(rkv_keep(keys, queries, 16), expected)
    assert torch.equal(snapkv_keep(keys, queries, 16), torch.tensor([list(range(8)) + list(range(32, 40))] * 2))


def test_batched_rows_equal_single_rows():
    rows = [random_inputs(2, 2, 80, 8, seed=s) for s in range(3)]
    keys = torch.stack([k for k, _ in rows])
    queries = torch.stack([q for _, q in rows])
    batched = keep_positions("rkv", keys, queries, 64)
    for r, (k, q) in enumerate(rows):
        assert torch.equal(batched[r], rkv_keep(k, q, 64))
    assert torch.equal(keep_positions("snapkv", keys, queries, 64)[1], snapkv_keep(*rows[1], 64))
    assert torch.equal(keep_positions("streaming", keys, queries, 64)[2, 1], streaming_keep(80, 64))


def test_last_window_always_kept_and_sorted():
    keys, queries = random_inputs(2, 2, 100, 8, seed=11)
    for budget in (16, 64):
        for kept in (rkv_keep(keys, queries, budget), snapkv_keep(keys, queries, budget)):
            assert (kept[:, -8:] == torch.arange(92, 100)).all()
            assert (kept.diff(dim=-1) > 0).all()


def test_gather_positions():
    x = torch.arange(2 * 5 * 3).reshape(2, 5, 3)
    kept = torch.tensor([[0, 4], [1, 2]])
    assert gather_positions(x, kept).tolist() == [[x[0, 0].tolist(), x[0, 4].tolist()],
                                                  [x[1, 1].tolist(), x[1, 2].tolist()]]


def test_bad_budgets_are_refused():
    keys, queries = random_inputs(1, 1, 20, 8, seed=0)
    with pytest.raises(ValueError, match=r"^budget 8 must be in \(8, 20\]$"):
        rkv_keep(keys, queries, 8)
    with pytest.raises(ValueError, match=r"^budget 21 must be in \(8, 20\]$"):
        rkv_keep(keys, queries, 21)
    assert rkv_keep(keys, queries, 20).tolist() == [list(range(20))]  # a budget of the whole length keeps all
    with pytest.raises(ValueError):
        streaming_keep(20, 20)
    names = "'rkv', 'snapkv', 'streaming', 'tova', 'h2o', 'knorm', 'keydiff', 'random', 'pyramidkv', 'adakv'"
    with pytest.raises(ValueError, match=rf"^policy 'none' does not compress; choose one of \({names}\)$"):
        keep_positions("none", keys, queries, 16)
