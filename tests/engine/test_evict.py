"""Eviction policies against a plain loop transcription of DESIGN section 3 (float64 Python)."""

from __future__ import annotations

import math
import re

import pytest
import torch

from kvrescue.engine.evict import (
    EVICTORS, H2O, RKV, TOVA, AdaKV, KeyDiff, KNorm, PyramidKV, Random, SnapKV, Streaming, gather_positions,
    importance, keep_positions, keep_top, received_attention, redundancy,
)
from kvrescue.shapes import OBSERVATION_WINDOW, SIMILARITY_ROWS
from tests.oracles import adakv_keep_past, rkv_keep, snapkv_keep, streaming_keep, streaming_scores


def loop_importance(keys: list, queries: list, h: int, h_kv: int, kernel: int) -> list[float]:
    """Importance of past positions for KV head h, written out position by position."""
    length, d = len(keys[h]), len(keys[h][0])
    group = len(queries) // h_kv
    past = length - 8
    mean = [0.0] * past
    for t in range(8):
        logits = []
        for j in range(past):
            best = -math.inf
            for g in range(group):
                q = queries[h * group + g][t]
                best = max(best, sum(q[c] * keys[h][j][c] for c in range(d)) / math.sqrt(d))
            logits.append(best)
        top = max(logits)
        exps = [math.exp(x - top) for x in logits]
        total = sum(exps)
        for j in range(past):
            mean[j] += exps[j] / total / 8
    half = kernel // 2
    return [max(mean[max(0, j - half): j + half + 1]) for j in range(past)]


def loop_redundancy(keys: list, h: int, threshold: float) -> list[float]:
    """Redundancy of every position for KV head h, written out position by position."""
    length = len(keys[h])
    unit = []
    for k in keys[h]:
        norm = math.sqrt(sum(x * x for x in k)) + 1e-8
        unit.append([x / norm for x in k])
    sim = [[0.0 if i == j else sum(a * b for a, b in zip(unit[i], unit[j])) for j in range(length)]
           for i in range(length)]
    for i in range(length):
        last = 0
        for j in range(length):
            if sim[i][j] > threshold:
                last = j
        sim[i][last] = 0.0
    r = [sum(sim[i][j] for i in range(length)) / length for j in range(length)]
    top = max(r)
    exps = [math.exp(x - top) for x in r]
    return [e / sum(exps) for e in exps]


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


def loop_keep(scores: list[float], length: int, budget: int) -> list[int]:
    """Top budget - 8 past positions (ties: earlier first) plus the last 8, ascending."""
    ranked = sorted(range(len(scores)), key=lambda j: (-scores[j], j))
    return sorted(ranked[: budget - 8] + list(range(length - 8, length)))


def loop_rkv(keys, queries, budget, lam=0.1, kernel=7, threshold=0.5, redundant=True):
    """Kept positions and scores per KV head, R-KV (or SnapKV when redundant=False)."""
    k, q = keys.double().tolist(), queries.double().tolist()
    h_kv, length = len(k), len(k[0])
    kept, scores = [], []
    for h in range(h_kv):
        imp = loop_importance(k, q, h, h_kv, kernel)
        if redundant:
            red = loop_redundancy(k, h, threshold)
            score = [lam * imp[j] - (1 - lam) * red[j] for j in range(length - 8)]
        else:
            score = imp
        scores.append(score)
        kept.append(loop_keep(score, length, budget))
    return torch.tensor(kept), torch.tensor(scores, dtype=torch.float64)


def random_inputs(h_kv: int, group: int, length: int, d: int, seed: int, shared: float = 0.8):
    """Random keys/queries; ``shared`` mixes a common direction into the keys so that about half of
    the key pairs pass the 0.5 cosine threshold (0: almost none do, so j* = 0 in most rows)."""
    gen = torch.Generator().manual_seed(seed)
    keys = torch.randn(h_kv, length, d, generator=gen)
    keys[:, 1:] += shared * keys[:, :1]
    queries = torch.randn(h_kv * group, 8, d, generator=gen) * 2
    return keys, queries


SHAPES = [  # (h_kv, group, length, d, budget, shared)
    (1, 1, 24, 8, 16, 0.8),
    (2, 1, 40, 8, 16, 0.8),
    (2, 3, 48, 16, 16, 0.0),
    (2, 4, 90, 8, 64, 0.8),
    (1, 7, 72, 12, 64, 0.0),
]


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


@pytest.mark.parametrize("shape", SHAPES[1::2])
def test_snapkv_matches_loop_transcription(shape):
    h_kv, group, length, d, budget, shared = shape
    keys, queries = random_inputs(h_kv, group, length, d, seed=length + 1, shared=shared)
    expected, _ = loop_rkv(keys, queries, budget, redundant=False)
    assert torch.equal(snapkv_keep(keys, queries, budget), expected)


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


def test_rkv_parameters_are_honoured():
    keys, queries = random_inputs(2, 2, 40, 8, seed=3)
    for lam, kernel, threshold in [(0.5, 3, 0.2), (0.9, 1, 0.8)]:
        expected, _ = loop_rkv(keys, queries, 16, lam=lam, kernel=kernel, threshold=threshold)
        got = rkv_keep(keys, queries, 16, lam=lam, kernel=kernel, threshold=threshold)
        assert torch.equal(got, expected)


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


def test_bf16_inputs_are_scored_in_fp32():
    keys, queries = random_inputs(2, 2, 48, 8, seed=7)
    keys, queries = keys.bfloat16(), queries.bfloat16()
    expected, _ = loop_rkv(keys.float(), queries.float(), 16)
    assert torch.equal(rkv_keep(keys, queries, 16), expected)


@pytest.mark.parametrize("length,budget", [(17, 16), (200, 64), (700, 512)])
def test_streaming_keeps_sinks_and_recent(length, budget):
    expected = list(range(4)) + list(range(length - (budget - 4), length))
    assert streaming_keep(length, budget).tolist() == expected


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


def test_a_similarity_exactly_at_the_threshold_is_not_redundant():
    # cos(k0, k1) = cos(k1, k2) = 0.5 exactly (unit norms), cos(k0, k2) = 0: no pair is strictly above 0.5,
    # so j* = 0 in every row and only column 0 is zeroed: r = [0, (0.5 + 0.5) / 3, 0.5 / 3]
    keys = torch.tensor([[[1.0, 0, 0, 0], [0.5, 0.5, 0.5, 0.5], [0, 1.0, 0, 0]]])
    assert redundancy(keys)[0].tolist() == pytest.approx(torch.softmax(torch.tensor([0.0, 1 / 3, 1 / 6]), -1).tolist())


def test_streaming_budget_bounds():
    assert streaming_keep(20, 12).tolist() == [0, 1, 2, 3, *range(12, 20)]  # the smallest budget: sinks + window
    with pytest.raises(ValueError, match=r"^need 12 <= budget 11 < length 20$"):
        streaming_keep(20, 11)


def test_every_policy_scores_on_the_keys_device():
    """The meta device stands in for a GPU: a position tensor made on the CPU beside it is an error."""
    keys, queries = random_inputs(2, 2, 40, 8, seed=1)
    received = torch.rand(1, 2, 40, device="meta")
    for policy in EVICTORS:
        kept = keep_positions(policy, keys[None].to("meta"), queries[None].to("meta"), 16, received)
        assert kept.device.type == "meta" and kept.shape == (1, 2, 16)


def test_keys_of_norm_near_the_epsilon_are_normalised_as_designed():
    # k / (|k| + 1e-8): keys of norm 1e-8 .. 3e-8 shrink to half .. three quarters of a unit vector, so their
    # similarities (and whether they pass the threshold) depend on the epsilon; a subtracted one would blow up.
    keys, _ = random_inputs(1, 1, 24, 8, seed=5)
    keys = keys / keys.norm(dim=-1, keepdim=True) * torch.linspace(1e-8, 3e-8, 24)[:, None]
    expected = loop_redundancy(keys.double().tolist(), 0, 0.5)
    assert redundancy(keys)[0].tolist() == pytest.approx(expected, rel=1e-4)


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
    from kvrescue.engine import evict

    keys, q = torch.randn(2, 2, 30, 8), torch.randn(2, 4, 12, 8)
    visible = torch.rand(2, 12, 30) < 0.7
    visible[..., 0] = True
    whole = received_attention(q, keys, visible)
    monkeypatch.setattr(evict, "SCORE_BYTES", 4 * 2 * 4 * 30 * 5)  # 5 queries a slice
    torch.testing.assert_close(received_attention(q, keys, visible), whole, rtol=1e-6, atol=1e-6)


def test_h2o_keeps_the_heaviest_received_and_the_window():
    keys, queries = random_inputs(2, 2, 40, 8, seed=9)
    received = torch.rand(2, 40, generator=torch.Generator().manual_seed(9))
    expected = torch.tensor([loop_keep(received[h, :32].tolist(), 40, 16) for h in range(2)])
    assert torch.equal(keep_positions("h2o", keys, queries, 16, received), expected)
    assert torch.equal(H2O().score(keys, queries, received), received[:, :32])
    with pytest.raises(ValueError, match="h2o scores the attention the cache accumulated"):
        keep_positions("h2o", keys, queries, 16)


def test_policies_are_frozen_dataclasses_of_their_parameters():
    assert {name: e.params() for name, e in EVICTORS.items()} == {
        "rkv": {"lam": 0.1, "kernel": 7, "threshold": 0.5}, "snapkv": {"kernel": 7}, "streaming": {"sinks": 4},
        "tova": {}, "h2o": {}, "knorm": {}, "keydiff": {}, "random": {"seed": 0}, "pyramidkv": {"kernel": 7, "beta": 20},
        "adakv": {"scores": "rkv", "safeguard": 0.2}}
    assert [e.name for e in EVICTORS.values() if e.accumulates] == ["h2o"]
    assert [e.name for e in EVICTORS.values() if e.allocates] == ["pyramidkv", "adakv"]
    with pytest.raises(AttributeError):
        EVICTORS["rkv"].lam = 0.5
    keys, queries = random_inputs(2, 2, 40, 8, seed=3)
    assert torch.equal(keep_positions(RKV(lam=0.5), keys, queries, 16), loop_rkv(keys, queries, 16, lam=0.5)[0])
    assert torch.equal(keep_positions(Streaming(sinks=2), keys, queries, 16)[0], streaming_keep(40, 16, sinks=2))


def test_evictor_specs_name_typed_parameters_or_a_one_line_error():
    from kvrescue.engine.evict import make_evictor, parse_evictor

    assert parse_evictor("rkv") == ("rkv", {}) and parse_evictor("h3o") == ("h3o", {})  # the caller refuses h3o
    assert parse_evictor("rkv:lam=0.2,kernel=5") == ("rkv", {"lam": 0.2, "kernel": 5})
    assert parse_evictor("adakv:scores=snapkv,safeguard=0.5") == ("adakv", {"scores": "snapkv", "safeguard": 0.5})
    assert make_evictor("streaming", {"sinks": 2}) == Streaming(sinks=2)
    for spec, message in [("h3o:x=1", "unknown evictor 'h3o'"), ("rkv:kernel=4", "kernel=4: the max-pool kernel"),
                          ("snapkv:kernel=2.5", "kernel must be int, not '2.5'"), ("rkv:lam", "'lam' is not FIELD=VALUE"),
                          ("tova:lam=1", "of one of tova's parameters (none)"), ("streaming:sinks=-1", "sinks=-1"),
                          ("random:seed=-1", "seed=-1: need 0 <= seed < 2**63"),
                          ("adakv:scores=h2o", "scores='h2o': choose rkv or snapkv"),
                          ("adakv:safeguard=1.5", "safeguard=1.5: need 0 <= safeguard <= 1"),
                          ("pyramidkv:beta=0", "beta=0: need 1 or more")]:
        with pytest.raises(ValueError, match=re.escape(message)):
            parse_evictor(spec)


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


# -- the query-free presses and the random baseline ------------------------------------------------------
def loop_norms(keys: list, h: int) -> list[float]:
    """Each past key's L2 norm for KV head h."""
    return [math.sqrt(sum(x * x for x in keys[h][j])) for j in range(len(keys[h]) - 8)]


def loop_keydiff(keys: list, h: int) -> list[float]:
    """kvpress's KeyDiffPress written out: minus each past key's cosine similarity with the mean of the head's unit
    keys (all cached keys, the window's too)."""
    units = [[x / max(math.sqrt(sum(y * y for y in k)), 1e-12) for x in k] for k in keys[h]]
    anchor = [sum(u[i] for u in units) / len(units) for i in range(len(units[0]))]
    a_norm = math.sqrt(sum(x * x for x in anchor))
    return [-sum(x * y for x, y in zip(k, anchor)) / (math.sqrt(sum(x * x for x in k)) * a_norm)
            for k in keys[h][:-8]]


@pytest.mark.parametrize("shape", SHAPES)
def test_knorm_keeps_the_smallest_keys_as_the_paper_and_kvpress_do(shape):
    h_kv, group, length, d, budget, shared = shape
    keys, queries = random_inputs(h_kv, group, length, d, seed=length, shared=shared)
    k = keys.double().tolist()
    expected = torch.tensor([loop_keep([-n for n in loop_norms(k, h)], length, budget) for h in range(h_kv)])
    assert torch.equal(keep_positions("knorm", keys, queries, budget), expected)
    assert torch.equal(keep_positions("knorm", keys, queries.flip(-2) * 3, budget), expected)  # query-free


@pytest.mark.parametrize("shape", SHAPES)
def test_keydiff_matches_a_transcription_of_kvpress(shape):
    h_kv, group, length, d, budget, shared = shape
    keys, queries = random_inputs(h_kv, group, length, d, seed=length + 1, shared=shared)
    k = keys.double().tolist()
    scores = torch.tensor([loop_keydiff(k, h) for h in range(h_kv)], dtype=torch.float64)
    assert torch.allclose(KeyDiff().score(keys, queries).double(), scores, atol=1e-5)
    expected = torch.tensor([loop_keep(scores[h].tolist(), length, budget) for h in range(h_kv)])
    assert torch.equal(keep_positions("keydiff", keys, queries, budget), expected)


U64 = (1 << 64) - 1


def splitmix64_finaliser(z: int) -> int:
    """SplitMix64's output function (Steele, Lea and Flood 2014; Vigna's splitmix64.c), on Python integers."""
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & U64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & U64
    return z ^ (z >> 31)


def loop_random(keys: torch.Tensor, seed: int) -> list[list[float]]:
    """The random press's scores per KV head, position by position on Python integers: the head's keys' fp32 bits
    (as signed 32-bit integers) plus their flat index << 32, each mixed, summed modulo 2^64; that XOR the mixed
    seed, mixed; plus the position, mixed; its top 53 bits over 2^53."""
    h_kv, length, d = keys.shape
    bits = keys.float().view(torch.int32).tolist()
    out = []
    for h in range(h_kv):
        fingerprint = sum(splitmix64_finaliser(((bits[h][j][i]) + ((j * d + i) << 32)) & U64)
                          for j in range(length) for i in range(d)) & U64
        base = splitmix64_finaliser(fingerprint ^ splitmix64_finaliser(seed))
        out.append([(splitmix64_finaliser((base + p) & U64) >> 11) / 2**53 for p in range(length - 8)])
    return out


def test_the_random_press_hashes_as_its_transcription_with_splitmix64s_published_output():
    from kvrescue.engine.evict import _mix

    golden = 0x9E3779B97F4A7C15  # splitmix64 seeded 0: its first state, whose output is 0xE220A8397B1DCDAF
    assert splitmix64_finaliser(golden) == 0xE220A8397B1DCDAF
    assert _mix(torch.tensor(golden - (1 << 64))).item() & U64 == 0xE220A8397B1DCDAF
    keys, queries = random_inputs(2, 2, 30, 4, seed=5)
    for seed in (0, 7, 2**62 + 3):
        assert Random(seed=seed).score(keys, queries).tolist() == loop_random(keys, seed)


def test_the_random_press_draws_uniformly_per_row_and_reproducibly():
    length, budget = 72, 24  # 64 past positions, 16 kept from them
    gen = torch.Generator().manual_seed(0)
    keys, queries = torch.randn(2000, 2, length, 8, generator=gen), torch.randn(2000, 2, 8, 8, generator=gen)
    kept = keep_positions("random", keys, queries, budget)
    assert torch.equal(kept, keep_positions("random", keys, queries, budget))  # reproducible
    assert all(torch.equal(keep_positions("random", keys[r : r + 1], queries[r : r + 1], budget), kept[r : r + 1])
               for r in (0, 1, 1999))  # a row draws alone as it does among others
    counts = torch.zeros(length - 8).index_add_(0, kept[..., :-8].flatten(), torch.ones(kept[..., :-8].numel()))
    expected = 2000 * 2 * 16 / 64  # each past position is kept with probability 16/64
    assert (counts - expected).abs().max() < 5 * math.sqrt(expected * (1 - 16 / 64))  # no position favoured
    assert not torch.equal(kept[0, 0], kept[0, 1]) and not torch.equal(kept[0], kept[1])  # heads and rows draw anew
    other = keep_positions(Random(seed=1), keys, queries, budget)
    assert (other != kept).any(dim=-1).float().mean() > 0.99  # another seed, another draw
    step = keys.clone()
    step[..., -1, :] += 1  # the same row one token later: a new draw
    assert (keep_positions("random", step, queries, budget) != kept).any(dim=-1).all()


def kvpress_layer_budget(q_len: int, window_size: int, compression_ratio: float, beta: int, num_layers: int,
                         layer_idx: int, least: float) -> int:
    """kvpress's `PyramidKVPress.get_layer_budget`, line by line (floats), its last check's lower bound `least` (kvpress:
    window_size, the window counted inside the budget)."""
    max_capacity_prompt = window_size + q_len * (1 - compression_ratio)
    min_num = (max_capacity_prompt - window_size) / beta
    max_num = (max_capacity_prompt - window_size) * 2 - min_num
    if max_num >= q_len - window_size:
        max_num = q_len - window_size
        min_num = (max_capacity_prompt - window_size) * 2 - max_num
    if not (q_len >= max_num >= min_num >= least):
        return round(q_len * (1 - compression_ratio))
    steps = (max_num - min_num) / (num_layers - 1)
    return round(max_num - layer_idx * steps)


@pytest.mark.parametrize("layers,budget,trigger,beta", [
    (2, 16, 144, 2), (2, 16, 144, 20), (28, 64, 192, 20), (28, 512, 640, 20), (24, 128, 256, 5), (5, 100, 228, 3),
    (3, 512, 520, 20), (36, 2048, 2176, 20), (7, 33, 161, 1)])
def test_pyramidkv_budgets_are_kvpress_formula_over_the_past_with_the_window_on_top(layers, budget, trigger, beta):
    """A compression from B' = trigger: kvpress's query the B' - W past positions, its window W (no layer keeps more
    than B' - W), its kept mean B - W, at least one past entry each; the window added to every layer's."""
    w = OBSERVATION_WINDOW
    ratio = 1 - (budget - w) / (trigger - w)
    want = [kvpress_layer_budget(trigger - w, w, ratio, beta, layers, layer, least=1) + w for layer in range(layers)]
    got = PyramidKV(beta=beta).layer_budgets(layers, budget, trigger)
    assert got == want
    assert sum(got) == layers * budget and all(w < b <= trigger - w for b in got)
    assert got == sorted(got, reverse=True) and (got[0] > got[-1]) == (beta > 1 and want[0] != budget)


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
