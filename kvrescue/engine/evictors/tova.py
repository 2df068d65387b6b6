"""TOVA (Oren et al. 2024): the newest query's attention alone."""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from kvrescue.engine.evictors.attention_scores import past_attention
from kvrescue.engine.evictors.base import Evictor
from kvrescue.evictor_catalogue import TOVASettings


@dataclass(frozen=True)
class TOVA(TOVASettings, Evictor):
    """TOVA (Oren et al. 2024): the `past_attention` of the newest query alone (its query group combined as for R-KV)."""

    def score(self, keys: Tensor, queries: Tensor, received: Tensor | None = None) -> Tensor:
        return past_attention(keys, queries[..., -1:, :])[..., 0, :]
