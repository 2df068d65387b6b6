"""What every evictor shares: the `Evictor` interface and the machinery around its score.

Every policy is a score over the *past* positions (all but the last ``OBSERVATION_WINDOW``); the shared
machinery keeps the top ``budget - OBSERVATION_WINDOW`` past positions plus the last ``OBSERVATION_WINDOW``, sorted by
position. All scores accept extra leading batch dimensions (rows), so the bounded cache scores
every row due for compression in one call:

    keys     [..., H_kv, L, D]     post-RoPE keys
    queries  [..., H_q, OBSERVATION_WINDOW, D] post-RoPE queries of the last OBSERVATION_WINDOW positions, H_q = g * H_kv
    received [..., H_kv, L]        (H2O) the attention each entry received since it entered, fp32, kept by the cache
    result   [..., H_kv, budget]   kept positions, ascending

Query heads ``h*g .. h*g+g-1`` share KV head ``h`` (the Hugging Face ``repeat_kv`` layout).
Equal scores are broken toward the earlier position.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from kvrescue.evictor_catalogue import EvictorSettings
from kvrescue.shapes import OBSERVATION_WINDOW


def top_order(scores: Tensor, k: int) -> Tensor:
    """The indices of the ``k`` highest scores along the last dimension, highest first (ties: earlier first)."""
    return torch.sort(scores, dim=-1, descending=True, stable=True).indices[..., :k]


def keep_top(scores: Tensor, budget: int) -> Tensor:
    """Top ``budget - OBSERVATION_WINDOW`` past positions by score (ties: earlier first) plus the last OBSERVATION_WINDOW, ascending."""
    past = scores.shape[-1]
    if not OBSERVATION_WINDOW < budget <= past + OBSERVATION_WINDOW:
        raise ValueError(f"budget {budget} must be in ({OBSERVATION_WINDOW}, {past + OBSERVATION_WINDOW}]")
    order = top_order(scores, budget - OBSERVATION_WINDOW)
    window = torch.arange(past, past + OBSERVATION_WINDOW, device=scores.device).expand(*scores.shape[:-1], OBSERVATION_WINDOW)
    return torch.cat([order, window], dim=-1).sort(dim=-1).values


def gather_positions(x: Tensor, kept: Tensor) -> Tensor:
    """Select positions along dim -2: x [..., H, L, D], kept [..., H, B] -> [..., H, B, D]."""
    return x.gather(-2, kept.unsqueeze(-1).expand(*kept.shape, x.shape[-1]))


@dataclass(frozen=True)
class Evictor(EvictorSettings):
    """One policy, kvpress style: its settings (`evictor_catalogue`) and `score(keys, queries, received)`, which ranks
    the past positions [..., H_kv, L - OBSERVATION_WINDOW] (higher is kept); `keep_top` and the bounded cache around
    it are shared by all. `received` is the attention each cached entry received since it entered, [..., H_kv, L]
    (`h2o.received_attention`), kept by the cache only for a policy that `accumulates`; else None. A policy that
    `allocates` gives the layers (`layer_budgets`) or a layer's KV heads (`keep_past`) budgets of their own, the same
    total as a uniform B; the others keep B per layer and KV head."""

    def score(self, keys: Tensor, queries: Tensor, received: Tensor | None = None) -> Tensor:
        raise NotImplementedError

    def layer_budgets(self, n_layers: int, budget: int, trigger: int) -> list[int]:
        """Each layer's budget: the entries per KV head a compression from B' = `trigger` keeps (B here)."""
        return [budget] * n_layers

    def keep_past(self, scores: Tensor, budget: int, most: int) -> Tensor:
        """Which past positions one layer keeps, bool like its scores [..., H_kv, past] (-inf where a head holds no
        entry): each KV head's top ``budget - OBSERVATION_WINDOW``. `most` bounds one head's entries (allocating
        policies)."""
        order = top_order(scores, budget - OBSERVATION_WINDOW)
        return torch.zeros_like(scores, dtype=torch.bool).scatter_(-1, order, True)
