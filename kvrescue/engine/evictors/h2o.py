"""H2O (Zhang et al. 2023) at decode time: the attention each entry received from every query since it entered,
observed by the bounded cache (`received_attention`)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from torch import Tensor

from kvrescue.engine.evictors.base import Evictor
from kvrescue.evictor_catalogue import H2OSettings
from kvrescue.shapes import OBSERVATION_WINDOW, SCORE_BYTES


def received_attention(q: Tensor, keys: Tensor, visible: Tensor, real: Tensor | None = None) -> Tensor:
    """H2O's observation: the attention each key receives from new queries, fp32 [R, H_kv, L]. Logits q.k/sqrt(d)
    of q [R, H_q, T, D] against keys [R, H_kv, L, D], max over each KV head's query group (before softmax, as
    `past_attention`), softmax over the keys each query sees (`visible` [R, T or 1, L]), summed over the queries
    where `real` [R, T] (all when None; padding queries are left out). Sliced over the queries so that one slice's
    logits stay within SCORE_BYTES (the softmax then holds 1/g of that)."""
    R, h_q, T, d = q.shape
    h_kv, length = keys.shape[1], keys.shape[2]
    g = h_q // h_kv
    k = keys.float().transpose(-1, -2)  # [R, H_kv, D, L]
    qg = q.float().view(R, h_kv, g, T, d)
    step = max(1, SCORE_BYTES // (4 * R * h_q * length))
    total = k.new_zeros(R, h_kv, length)
    for t in range(0, T, step):
        part = qg[:, :, :, t : t + step]  # the group's queries as rows of one matmul per KV head
        n = part.shape[3]
        logits = (part.reshape(R, h_kv, g * n, d) @ k).div_(math.sqrt(d)).view(R, h_kv, g, n, length).amax(dim=2)
        seen = visible[:, t : t + step] if visible.shape[1] > 1 else visible
        probs = logits.masked_fill_(~seen[:, None], -math.inf).softmax(dim=-1)
        if real is not None:
            probs.mul_(real[:, None, t : t + step, None])
        total += probs.sum(dim=2)
    return total


@dataclass(frozen=True)
class H2O(H2OSettings, Evictor):
    """H2O (Zhang et al. 2023) at decode time: the attention each past entry received from every query since it
    entered (`received_attention`, accumulated by the cache), the heaviest kept."""

    def score(self, keys: Tensor, queries: Tensor, received: Tensor | None = None) -> Tensor:
        if received is None:
            raise ValueError("h2o scores the attention the cache accumulated: pass `received`")
        return received[..., :-OBSERVATION_WINDOW]
