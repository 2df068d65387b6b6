"""R-KV (Cai et al. 2025): attention importance minus key redundancy."""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from kvrescue.engine.evictors.attention_scores import importance, redundancy
from kvrescue.engine.evictors.base import Evictor
from kvrescue.evictor_catalogue import RKVSettings
from kvrescue.shapes import OBSERVATION_WINDOW


@dataclass(frozen=True)
class RKV(RKVSettings, Evictor):
    """R-KV score lam * importance - (1 - lam) * redundancy over the past positions."""

    def score(self, keys: Tensor, queries: Tensor, received: Tensor | None = None) -> Tensor:
        red = redundancy(keys, threshold=self.threshold)[..., :-OBSERVATION_WINDOW]
        return self.lam * importance(keys, queries, kernel=self.kernel) - (1 - self.lam) * red
