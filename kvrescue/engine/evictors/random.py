"""The random baseline: a seeded uniform choice of the past positions, drawn by hashing (SplitMix64's finaliser)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from kvrescue.engine.evictors.base import Evictor
from kvrescue.evictor_catalogue import RandomSettings
from kvrescue.shapes import OBSERVATION_WINDOW


@dataclass(frozen=True)
class Random(RandomSettings, Evictor):
    """A uniform random choice of the past positions, seeded: each position's score is a hash of `seed`, the row's
    keys (`key_fingerprint`: another row, layer, head or step draws anew) and the position, so a row draws the same
    whatever it is compressed with, on any device."""

    def score(self, keys: Tensor, queries: Tensor, received: Tensor | None = None) -> Tensor:
        past = keys.shape[-2] - OBSERVATION_WINDOW
        base = _mix(key_fingerprint(keys) ^ _mix(torch.tensor(self.seed, device=keys.device)))
        drawn = _mix(base.unsqueeze(-1) + torch.arange(past, device=keys.device))
        return _unit_interval(drawn)


_MASKS = {shift: (1 << (64 - shift)) - 1 for shift in (30, 27, 31)}  # a logical right shift of int64, as a mask


def _signed(x: int) -> int:
    return x - (1 << 64) if x >= 1 << 63 else x


_SPLITMIX = (_signed(0xBF58476D1CE4E5B9), _signed(0x94D049BB133111EB))


def _mix(x: Tensor) -> Tensor:
    """SplitMix64's finaliser on int64 tensors (products wrap modulo 2^64 on every device)."""
    x = x ^ ((x >> 30) & _MASKS[30])
    x = x * _SPLITMIX[0]
    x = x ^ ((x >> 27) & _MASKS[27])
    x = x * _SPLITMIX[1]
    return x ^ ((x >> 31) & _MASKS[31])


def key_fingerprint(keys: Tensor) -> Tensor:
    """A 64-bit hash of each head's cached keys [..., H_kv, L, D] -> int64 [..., H_kv]: every key's fp32 bits mixed
    with its index, summed modulo 2^64 (a sum of integers, the same in any order, so batch-invariant)."""
    bits = keys.float().contiguous().view(torch.int32).to(torch.int64)
    index = torch.arange(bits.shape[-2] * bits.shape[-1], device=keys.device).view(bits.shape[-2:])
    return _mix(bits + (index << 32)).sum(dim=(-2, -1))


def _unit_interval(x: Tensor) -> Tensor:
    """The top 53 bits of int64 hashes as float64 in [0, 1)."""
    return ((x >> 11) & ((1 << 53) - 1)).double() / 2**53
