"""KeyDiff (Park et al. 2025): the keys least similar to the mean key, query-free."""

from __future__ import annotations

from dataclasses import dataclass

import torch.nn.functional as F
from torch import Tensor

from kvrescue.engine.evictors.base import Evictor
from kvrescue.evictor_catalogue import KeyDiffSettings
from kvrescue.shapes import OBSERVATION_WINDOW


@dataclass(frozen=True)
class KeyDiff(KeyDiffSettings, Evictor):
    """KeyDiff (Park et al. 2025): the keys least similar to the anchor (the mean of the head's unit keys) kept,
    query-free; the anchor is taken over every cached key, as kvpress's `KeyDiffPress` does."""

    def score(self, keys: Tensor, queries: Tensor, received: Tensor | None = None) -> Tensor:
        k = keys.float()
        anchor = F.normalize(k, dim=-1).mean(dim=-2, keepdim=True)
        return -F.cosine_similarity(k[..., :-OBSERVATION_WINDOW, :], anchor, dim=-1)
