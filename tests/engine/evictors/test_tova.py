"""TOVA against its loop transcription."""

from __future__ import annotations

import math

import pytest
import torch

from kvrescue.engine.evictors.registry import keep_positions
from kvrescue.engine.evictors.tova import TOVA
from tests.engine.evictors.loops import SHAPES, loop_keep, random_inputs


def loop_tova(keys: list, queries: list, h: int, h_kv: int) -> list[float]:
    """TOVA's score of past positions for KV head h: the newest query's attention, written out position by position
    (logits maxed over the KV head's query group before the softmax)."""
    length, d = len(keys[h]), len(keys[h][0])
    group = len(queries) // h_kv
    logits = [max(sum(queries[h * group + g][-1][c] * keys[h][j][c] for c in range(d)) / math.sqrt(d)
                  for g in range(group)) for j in range(length - 8)]
    top = max(logits)
    exps = [math.exp(x - top) for x in logits]
    return [e / sum(exps) for e in exps]


@pytest.mark.parametrize("shape", SHAPES)
def test_tova_matches_loop_transcription(shape):
    h_kv, group, length, d, budget, shared = shape
    keys, queries = random_inputs(h_kv, group, length, d, seed=length + 3, shared=shared)
    k, q = keys.double().tolist(), queries.double().tolist()
    scores = [loop_tova(k, q, h, h_kv) for h in range(h_kv)]
    torch.testing.assert_close(TOVA().score(keys, queries).double(), torch.tensor(scores, dtype=torch.float64),
                               rtol=1e-4, atol=1e-7)
    expected = torch.tensor([loop_keep(s, length, budget) for s in scores])
    assert torch.equal(keep_positions("tova", keys, queries, budget), expected)
    earlier = queries.clone()
    earlier[:, -1] = torch.randn_like(earlier[:, -1])  # only the newest query counts: another one moves the scores
    assert not torch.equal(TOVA().score(keys, earlier), TOVA().score(keys, queries))
    same_newest = queries.clone()
    same_newest[:, :-1] = 0.0
    assert torch.equal(TOVA().score(keys, same_newest), TOVA().score(keys, queries))
