"""Knorm (Devoto et al. 2024): the keys of smallest L2 norm, query-free."""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from kvrescue.engine.evictors.base import Evictor
from kvrescue.evictor_catalogue import KNormSettings
from kvrescue.shapes import OBSERVATION_WINDOW


@dataclass(frozen=True)
class KNorm(KNormSettings, Evictor):
    """Knorm (Devoto et al. 2024): the keys of smallest L2 norm kept, query-free."""

    def score(self, keys: Tensor, queries: Tensor, received: Tensor | None = None) -> Tensor:
        return -keys[..., :-OBSERVATION_WINDOW, :].float().norm(dim=-1)
