"""Knorm: the keys of smallest norm kept, query-free."""

from __future__ import annotations

import math

import pytest
import torch

from kvrescue.engine.evictors.registry import keep_positions
from tests.engine.evictors.loops import SHAPES, loop_keep, random_inputs


def loop_norms(keys: list, h: int) -> list[float]:
    """Each past key's L2 norm for KV head h."""
    return [math.sqrt(sum(x * x for x in keys[h][j])) for j in range(len(keys[h]) - 8)]


@pytest.mark.parametrize("shape", SHAPES)
def test_knorm_keeps_the_smallest_keys_as_the_paper_and_kvpress_do(shape):
    h_kv, group, length, d, budget, shared = shape
    keys, queries = random_inputs(h_kv, group, length, d, seed=length, shared=shared)
    k = keys.double().tolist()
    expected = torch.tensor([loop_keep([-n for n in loop_norms(k, h)], length, budget) for h in range(h_kv)])
    assert torch.equal(keep_positions("knorm", keys, queries, budget), expected)
    assert torch.equal(keep_positions("knorm", keys, queries.flip(-2) * 3, budget), expected)  # query-free
