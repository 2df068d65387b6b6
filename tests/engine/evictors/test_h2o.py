"""H2O: the attention received (`received_attention`) against its loop transcription, and what H2O keeps."""

from __future__ import annotations

import math

import pytest
import torch

from kvrescue.engine.evictors import h2o
from kvrescue.engine.evictors.h2o import H2O, received_attention
from kvrescue.engine.evictors.registry import keep_positions
from tests.engine.evictors.loops import SHAPES, loop_keep, random_inputs


def loop_received(q: list, keys: list, visible: list, real: list, h: int, h_kv: int) -> list[float]:
    """H2O's attention received by each key of KV head h from the real queries, written out query by query
    (logits maxed over the KV head's query group before the softmax over the keys the query sees)."""
    length, d = len(keys[h]), len(keys[h][0])
    group = len(q) // h_kv
    total = [0.0] * length
    for t in range(len(q[0])):
        if not real[t]:
            continue
        seen = [j for j in range(length) if visible[t][j]]
        logits = {j: max(sum(q[h * group + g][t][c] * keys[h][j][c] for c in range(d)) / math.sqrt(d)
                         for g in range(group)) for j in seen}
        top = max(logits.values())
        denominator = sum(math.exp(x - top) for x in logits.values())
        for j in seen:
            total[j] += math.exp(logits[j] - top) / denominator
    return total


@pytest.mark.parametrize("shape", SHAPES)
def test_received_attention_matches_loop_transcription(shape):
    """Rows of queries right padded, each query seeing its own prefix of the keys (a prefill after cached entries)."""
    h_kv, group, length, d, _, _ = shape
    gen = torch.Generator().manual_seed(length + 4)
    rows, t = 3, 5
    keys = torch.randn(rows, h_kv, length, d, generator=gen)
    q = torch.randn(rows, h_kv * group, t, d, generator=gen) * 2
    cached, new = torch.tensor([length - t, 2, 9]), torch.tensor([t, 3, 1])
    j = torch.arange(length)
    visible = (j <= cached[:, None, None] + torch.arange(t)[:, None]) & (j < (cached + new)[:, None, None])
    real = torch.arange(t) < new[:, None]
    got = received_attention(q, keys, visible, real)
    expected = [[loop_received(q[r].double().tolist(), keys[r].double().tolist(), visible[r].tolist(), real[r].tolist(),
                               h, h_kv) for h in range(h_kv)] for r in range(rows)]
    torch.testing.assert_close(got.double(), torch.tensor(expected, dtype=torch.float64), rtol=1e-5, atol=1e-7)
    assert got.sum().item() == pytest.approx(h_kv * new.sum().item(), rel=1e-5)  # a unit of attention per real query


def test_received_attention_slices_the_queries_within_score_bytes(monkeypatch):
    keys, q = torch.randn(2, 2, 30, 8), torch.randn(2, 4, 12, 8)
    visible = torch.rand(2, 12, 30) < 0.7
    visible[..., 0] = True
    whole = received_attention(q, keys, visible)
    monkeypatch.setattr(h2o, "SCORE_BYTES", 4 * 2 * 4 * 30 * 5)  # 5 queries a slice
    torch.testing.assert_close(received_attention(q, keys, visible), whole, rtol=1e-6, atol=1e-6)


def test_h2o_keeps_the_heaviest_received_and_the_window():
    keys, queries = random_inputs(2, 2, 40, 8, seed=9)
    received = torch.rand(2, 40, generator=torch.Generator().manual_seed(9))
    expected = torch.tensor([loop_keep(received[h, :32].tolist(), 40, 16) for h in range(2)])
    assert torch.equal(keep_positions("h2o", keys, queries, 16, received), expected)
    assert torch.equal(H2O().score(keys, queries, received), received[:, :32])
    with pytest.raises(ValueError, match="h2o scores the attention the cache accumulated"):
        keep_positions("h2o", keys, queries, 16)
