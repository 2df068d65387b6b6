"""Plain loop transcriptions of DESIGN section 3 (float64 Python) that several evictors' tests share, and their
random inputs."""

from __future__ import annotations

import math

import torch


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
