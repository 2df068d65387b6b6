"""KeyDiff against a transcription of kvpress's `KeyDiffPress`."""

from __future__ import annotations

import math

import pytest
import torch

from kvrescue.engine.evictors.keydiff import KeyDiff
from kvrescue.engine.evictors.registry import keep_positions
from tests.engine.evictors.loops import SHAPES, loop_keep, random_inputs


def loop_keydiff(keys: list, h: int) -> list[float]:
    """kvpress's KeyDiffPress written out: minus each past key's cosine similarity with the mean of the head's unit
    keys (all cached keys, the window's too)."""
    units = [[x / max(math.sqrt(sum(y * y for y in k)), 1e-12) for x in k] for k in keys[h]]
    anchor = [sum(u[i] for u in units) / len(units) for i in range(len(units[0]))]
    a_norm = math.sqrt(sum(x * x for x in anchor))
    return [-sum(x * y for x, y in zip(k, anchor)) / (math.sqrt(sum(x * x for x in k)) * a_norm)
            for k in keys[h][:-8]]


@pytest.mark.parametrize("shape", SHAPES)
def test_keydiff_matches_a_transcription_of_kvpress(shape):
    h_kv, group, length, d, budget, shared = shape
    keys, queries = random_inputs(h_kv, group, length, d, seed=length + 1, shared=shared)
    k = keys.double().tolist()
    scores = torch.tensor([loop_keydiff(k, h) for h in range(h_kv)], dtype=torch.float64)
    assert torch.allclose(KeyDiff().score(keys, queries).double(), scores, atol=1e-5)
    expected = torch.tensor([loop_keep(scores[h].tolist(), length, budget) for h in range(h_kv)])
    assert torch.equal(keep_positions("keydiff", keys, queries, budget), expected)
