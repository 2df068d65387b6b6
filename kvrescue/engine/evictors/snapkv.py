"""SnapKV (Li et al. 2024) at decode time."""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from kvrescue.engine.evictors.attention_scores import importance
from kvrescue.engine.evictors.base import Evictor
from kvrescue.evictor_catalogue import SnapKVSettings


@dataclass(frozen=True)
class SnapKV(SnapKVSettings, Evictor):
    """Decode-time SnapKV: R-KV without the redundancy term."""

    def score(self, keys: Tensor, queries: Tensor, received: Tensor | None = None) -> Tensor:
        return importance(keys, queries, kernel=self.kernel)
