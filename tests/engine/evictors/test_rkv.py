"""R-KV against its loop transcription, its parameters honoured."""

from __future__ import annotations

import pytest
import torch

from kvrescue.engine.evictors.rkv import RKV
from kvrescue.engine.evictors.snapkv import SnapKV
from tests.engine.evictors.loops import SHAPES, loop_rkv, random_inputs
from tests.oracles import rkv_keep, snapkv_keep, streaming_keep, streaming_scores


@pytest.mark.parametrize("shape", SHAPES)
def test_rkv_matches_loop_transcription(shape):
    h_kv, group, length, d, budget, shared = shape
    keys, queries = random_inputs(h_kv, group, length, d, seed=length, shared=shared)
    expected, expected_scores = loop_rkv(keys, queries, budget)
    torch.testing.assert_close(RKV().score(keys, queries).double(), expected_scores,
                               rtol=1e-4, atol=1e-7)
    kept = rkv_keep(keys, queries, budget)
    assert kept.dtype == torch.long and kept.shape == (h_kv, budget)
    assert torch.equal(kept, expected)


def test_rkv_parameters_are_honoured():
    keys, queries = random_inputs(2, 2, 40, 8, seed=3)
    for lam, kernel, threshold in [(0.5, 3, 0.2), (0.9, 1, 0.8)]:
        expected, _ = loop_rkv(keys, queries, 16, lam=lam, kernel=kernel, threshold=threshold)
        got = rkv_keep(keys, queries, 16, lam=lam, kernel=kernel, threshold=threshold)
        assert torch.equal(got, expected)


def test_bf16_inputs_are_scored_in_fp32():
    keys, queries = random_inputs(2, 2, 48, 8, seed=7)
    keys, queries = keys.bfloat16(), queries.bfloat16()
    expected, _ = loop_rkv(keys.float(), queries.float(), 16)
    assert torch.equal(rkv_keep(keys, queries, 16), expected)


def test_every_option_changes_what_is_kept_and_is_honoured():
    keys, queries = random_inputs(2, 2, 40, 8, seed=3)
    default, _ = loop_rkv(keys, queries, 16)
    for lam, kernel, threshold in [(0.1, 7, 0.7), (0.1, 3, 0.5), (0.5, 7, 0.5)]:  # one option each
        expected, scores = loop_rkv(keys, queries, 16, lam=lam, kernel=kernel, threshold=threshold)
        assert not torch.equal(expected, default)  # so an option that is not passed on shows
        torch.testing.assert_close(RKV(lam=lam, kernel=kernel, threshold=threshold).score(keys, queries).double(),
                                   scores, rtol=1e-4, atol=1e-7)
        assert torch.equal(rkv_keep(keys, queries, 16, lam=lam, kernel=kernel, threshold=threshold), expected)
    expected, scores = loop_rkv(keys, queries, 16, kernel=3, redundant=False)
    assert not torch.equal(expected, loop_rkv(keys, queries, 16, redundant=False)[0])
    torch.testing.assert_close(SnapKV(kernel=3).score(keys, queries).double(), scores, rtol=1e-4, atol=1e-7)
    assert torch.equal(snapkv_keep(keys, queries, 16, kernel=3), expected)
    assert streaming_keep(40, 16, sinks=2).tolist() == [0, 1, *range(26, 40)]
    assert streaming_scores(40, sinks=2)[:3].tolist() == streaming_scores(40, sinks=2)[:3].sort(descending=True)[0].tolist()
