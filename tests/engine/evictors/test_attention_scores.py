"""The shared attention scores (importance, redundancy) against their loop transcriptions."""

from __future__ import annotations

import pytest
import torch

from kvrescue.engine.evictors.attention_scores import importance, redundancy
from kvrescue.engine.evictors.base import keep_top
from kvrescue.engine.evictors.registry import keep_positions
from kvrescue.shapes import OBSERVATION_WINDOW, SIMILARITY_ROWS
from tests.engine.evictors.loops import SHAPES, loop_importance, loop_redundancy, random_inputs


@pytest.mark.parametrize("shape", SHAPES)
def test_importance_and_redundancy_with_their_defaults_match_loop_transcriptions(shape):
    h_kv, group, length, d, _, shared = shape
    keys, queries = random_inputs(h_kv, group, length, d, seed=length + 2, shared=shared)
    k, q = keys.double().tolist(), queries.double().tolist()
    torch.testing.assert_close(importance(keys, queries).double(),  # kernel 7
                               torch.tensor([loop_importance(k, q, h, h_kv, 7) for h in range(h_kv)], dtype=torch.float64),
                               rtol=1e-4, atol=1e-7)
    torch.testing.assert_close(redundancy(keys).double(),  # threshold 0.5
                               torch.tensor([loop_redundancy(k, h, 0.5) for h in range(h_kv)], dtype=torch.float64),
                               rtol=1e-4, atol=1e-7)


def test_a_similarity_exactly_at_the_threshold_is_not_redundant():
    # cos(k0, k1) = cos(k1, k2) = 0.5 exactly (unit norms), cos(k0, k2) = 0: no pair is strictly above 0.5,
    # so j* = 0 in every row and only column 0 is zeroed: r = [0, (0.5 + 0.5) / 3, 0.5 / 3]
    keys = torch.tensor([[[1.0, 0, 0, 0], [0.5, 0.5, 0.5, 0.5], [0, 1.0, 0, 0]]])
    assert redundancy(keys)[0].tolist() == pytest.approx(torch.softmax(torch.tensor([0.0, 1 / 3, 1 / 6]), -1).tolist())


def test_keys_of_norm_near_the_epsilon_are_normalised_as_designed():
    # k / (|k| + 1e-8): keys of norm 1e-8 .. 3e-8 shrink to half .. three quarters of a unit vector, so their
    # similarities (and whether they pass the threshold) depend on the epsilon; a subtracted one would blow up.
    keys, _ = random_inputs(1, 1, 24, 8, seed=5)
    keys = keys / keys.norm(dim=-1, keepdim=True) * torch.linspace(1e-8, 3e-8, 24)[:, None]
    expected = loop_redundancy(keys.double().tolist(), 0, 0.5)
    assert redundancy(keys)[0].tolist() == pytest.approx(expected, rel=1e-4)


def one_shot_redundancy(keys: torch.Tensor, threshold: float = 0.5) -> torch.Tensor:
    """R-KV's redundancy from the whole L x L similarity at once (the reference code's form, in keys' precision)."""
    k = keys / (keys.norm(dim=-1, keepdim=True) + 1e-8)
    sim = k @ k.transpose(-1, -2)
    sim.diagonal(dim1=-2, dim2=-1).zero_()
    pos = torch.arange(sim.shape[-1])
    last_similar = torch.where(sim > threshold, pos, 0).amax(dim=-1, keepdim=True)
    sim.scatter_(-1, last_similar, 0.0)
    return sim.mean(dim=-2).softmax(dim=-1)


def test_a_long_rows_redundancy_is_scored_in_slices_of_rows_as_a_whole():
    """Up to SIMILARITY_ROWS keys: bitwise the one-shot similarity's; past it (three slices, near-duplicates across
    slices) the same within float64's view of fp32 rounding, and R-KV keeps the same positions."""
    torch.manual_seed(5)
    short = torch.randn(2, 2, SIMILARITY_ROWS, 16)
    assert torch.equal(redundancy(short), one_shot_redundancy(short))
    long = torch.randn(1, 2, 2 * SIMILARITY_ROWS + 300, 16)
    long[..., 2 * SIMILARITY_ROWS + 7, :] = long[..., 3, :] * 1.01  # a near-duplicate two slices apart
    torch.testing.assert_close(redundancy(long).double(), one_shot_redundancy(long.double()), rtol=1e-5, atol=0)
    queries = torch.randn(1, 4, OBSERVATION_WINDOW, 16)
    whole = 0.1 * importance(long, queries) - 0.9 * one_shot_redundancy(long)[..., :-OBSERVATION_WINDOW]
    assert torch.equal(keep_positions("rkv", long, queries, 256), keep_top(whole, 256))
