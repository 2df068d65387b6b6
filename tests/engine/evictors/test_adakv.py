"""Ada-KV against a transcription of kvpress's `AdaKVPress`, and the scores it names."""

from __future__ import annotations

import math

import pytest
import torch

from kvrescue.engine.evictors.adakv import AdaKV
from kvrescue.engine.evictors.pyramidkv import PyramidKV
from kvrescue.engine.evictors.rkv import RKV
from kvrescue.engine.evictors.snapkv import SnapKV
from tests.engine.evictors.loops import random_inputs
from tests.oracles import adakv_keep_past


@pytest.mark.parametrize("heads,past,budget,most,safeguard", [
    (2, 40, 16, 40, 0.2), (4, 136, 16, 136, 0.0), (4, 136, 64, 72, 0.2), (8, 300, 128, 300, 0.5), (3, 50, 20, 48, 1.0)])
def test_adakv_keeps_what_a_transcription_of_kvpress_keeps(heads, past, budget, most, safeguard):
    gen = torch.Generator().manual_seed(past)
    scores = torch.rand(2, heads, past, generator=gen) ** 3  # skewed: the heads' score mass differs
    scores[0, 0] *= 4
    scores[1, :, -5:] = -math.inf  # a head's holes (after its last kept entries) are no entries
    scores[1, :, :3] = 0.5  # ties
    keep = AdaKV(safeguard=safeguard).keep_past(scores, budget, most)
    for row in range(2):
        got = [torch.nonzero(keep[row, h]).flatten().tolist() for h in range(heads)]
        assert got == adakv_keep_past(scores[row].tolist(), budget, most, safeguard)
        assert sum(map(len, got)) == heads * (budget - 8) and max(map(len, got)) <= most - 8
        assert safeguard == 1.0 or row or len(set(map(len, got))) > 1  # row 0's head 0 holds more of the mass
    uniform = AdaKV(safeguard=1.0).keep_past(scores, budget, most)
    assert torch.equal(uniform, RKV().keep_past(scores, budget, most))  # every head its top B - W: R-KV's own


def test_adakv_scores_with_the_policy_it_names():
    keys, queries = random_inputs(2, 2, 40, 8, seed=5)
    assert torch.equal(AdaKV().score(keys, queries), RKV().score(keys, queries))
    assert torch.equal(AdaKV(scores="snapkv").score(keys, queries), SnapKV().score(keys, queries))
    assert torch.equal(PyramidKV(kernel=5).score(keys, queries), SnapKV(kernel=5).score(keys, queries))
