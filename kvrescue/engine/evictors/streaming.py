"""StreamingLLM (Xiao et al. 2023): the attention sinks and the most recent positions."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from kvrescue.engine.evictors.base import Evictor
from kvrescue.evictor_catalogue import StreamingSettings
from kvrescue.shapes import OBSERVATION_WINDOW


@dataclass(frozen=True)
class Streaming(StreamingSettings, Evictor):
    """StreamingLLM as a score: the ``sinks`` first positions first, then by recency."""

    def score(self, keys: Tensor, queries: Tensor, received: Tensor | None = None) -> Tensor:
        past = keys.shape[-2] - OBSERVATION_WINDOW
        score = torch.arange(past, device=keys.device, dtype=torch.float32)
        score[: self.sinks] = math.inf
        return score.expand(*keys.shape[:-2], past)
