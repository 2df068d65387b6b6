"""The random baseline: its hash against a transcription, and its draws uniform and reproducible."""

from __future__ import annotations

import math

import torch

from kvrescue.engine.evictors.random import Random, _mix
from kvrescue.engine.evictors.registry import keep_positions
from tests.engine.evictors.loops import random_inputs


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
