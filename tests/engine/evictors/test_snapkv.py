"""Decode-time SnapKV against its loop transcription."""

from __future__ import annotations

import pytest
import torch

from tests.engine.evictors.loops import SHAPES, loop_rkv, random_inputs
from tests.oracles import snapkv_keep


@pytest.mark.parametrize("shape", SHAPES[1::2])
def test_snapkv_matches_loop_transcription(shape):
    h_kv, group, length, d, budget, shared = shape
    keys, queries = random_inputs(h_kv, group, length, d, seed=length + 1, shared=shared)
    expected, _ = loop_rkv(keys, queries, budget, redundant=False)
    assert torch.equal(snapkv_keep(keys, queries, budget), expected)
