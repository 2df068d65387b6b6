"""Ada-KV (Feng et al. 2024) at decode time: a layer's KV heads share its budget by score mass."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from kvrescue.engine.evictors.base import Evictor, top_order
from kvrescue.engine.evictors.rkv import RKV
from kvrescue.engine.evictors.snapkv import SnapKV
from kvrescue.evictor_catalogue import AdaKVSettings
from kvrescue.shapes import OBSERVATION_WINDOW

SCORERS = {e.name: e for e in (RKV(), SnapKV())}  # `AdaKVSettings.scores` (`ADAKV_SCORES`): at their defaults


@dataclass(frozen=True)
class AdaKV(AdaKVSettings, Evictor):
    """Ada-KV (Feng et al. 2024) at decode time: a layer's KV heads share its budget by score mass, kvpress's
    `AdaKVPress.compress`: each head's top `safeguard` x (B - OBSERVATION_WINDOW) past positions first, then the
    layer's H_kv x (B - OBSERVATION_WINDOW) best of all its heads' past positions (ties: lower head, earlier
    position); no head keeps more than B' - OBSERVATION_WINDOW entries. Scored by R-KV or SnapKV (`scores`, their
    default settings)."""

    def score(self, keys: Tensor, queries: Tensor, received: Tensor | None = None) -> Tensor:
        return SCORERS[self.scores].score(keys, queries, received)

    def keep_past(self, scores: Tensor, budget: int, most: int) -> Tensor:
        heads, past = scores.shape[-2:]
        share = budget - OBSERVATION_WINDOW
        ranked = top_order(scores, past)  # each head's positions, best first
        rank = torch.empty_like(ranked).scatter_(-1, ranked, torch.arange(past, device=scores.device).expand_as(ranked))
        boosted = scores.masked_fill(rank < int(share * self.safeguard), math.inf)
        boosted = boosted.masked_fill(rank >= most - OBSERVATION_WINDOW, -math.inf)
        chosen = top_order(boosted.flatten(-2), heads * share)
        keep = torch.zeros_like(boosted.flatten(-2), dtype=torch.bool).scatter_(-1, chosen, True)
        return keep.view(scores.shape)
