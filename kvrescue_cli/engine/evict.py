"""KV eviction policies as pure tensor functions (DESIGN section 3).

Every policy is a score over the *past* positions (all but the last ``OBSERVATION_WINDOW``); the shared
machinery keeps the top ``budget - OBSERVATION_WINDOW`` past positions plus the last ``OBSERVATION_WINDOW``, sorted by
position. All functions accept extra leading batch dimensions (rows), so the bounded cache scores
every row due for compression in one call:

    keys     [..., H_kv, L, D]     post-RoPE keys
    queries  [..., H_q, OBSERVATION_WINDOW, D] post-RoPE queries of the last OBSERVATION_WINDOW positions, H_q = g * H_kv
    result   [..., H_kv, budget]   kept positions, ascending

Query heads ``h*g .. h*g+g-1`` share KV head ``h`` (the Hugging Face ``repeat_kv`` layout).
Equal scores are broken toward the earlier position.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from kvrescue_cli.shapes import OBSERVATION_WINDOW  # the last 8 positions, always kept
MIN_BUDGET = 2 * OBSERVATION_WINDOW  # the smallest budget B any evictor accepts


def past_attention(keys: Tensor, queries: Tensor) -> Tensor:
    """Each query's attention over the past keys, fp32, [..., H_kv, W, L - OBSERVATION_WINDOW]: logits q.k/sqrt(d), max over
    each KV head's query group (before softmax), softmax over the past keys."""
    h_kv, d = keys.shape[-3], keys.shape[-1]
    h_q, w = queries.shape[-3], queries.shape[-2]
    q = queries.float().reshape(*queries.shape[:-3], h_kv, h_q // h_kv, w, d)
    logits = q @ keys.float()[..., :-OBSERVATION_WINDOW, :].unsqueeze(-3).transpose(-1, -2) / math.sqrt(d)
    return logits.amax(dim=-3).softmax(dim=-1)


def importance(keys: Tensor, queries: Tensor, *, kernel: int = 7) -> Tensor:
    """SnapKV/R-KV attention importance of each past position, fp32, [..., H_kv, L - OBSERVATION_WINDOW]: the window
    queries' `past_attention` averaged, then 1-D max-pooled (kernel, stride 1, same padding)."""
    attn = past_attention(keys, queries).mean(dim=-2)  # [..., H_kv, L - OBSERVATION_WINDOW]
    flat = attn.reshape(-1, attn.shape[-1])
    return F.max_pool1d(flat, kernel, stride=1, padding=kernel // 2).reshape(attn.shape)


def redundancy(keys: Tensor, *, threshold: float = 0.5) -> Tensor:
    """R-KV redundancy of every cached position, fp32, [..., H_kv, L] (softmax over all L).

    S = cosine similarity of the keys with a zero diagonal. In each row i the entry of the most
    recent j with S[i, j] > threshold is zeroed, so key i counts against every near-duplicate but
    its newest one, which is thereby spared. When no j qualifies, j* = 0 as in the reference code:
    S[i, 0] is zeroed instead, so position 0 (usually BOS, the attention sink) collects no
    similarity from keys without near-duplicates and looks slightly less redundant.
    r_j = mean over rows i of S[i, j], then softmax over j (over all L positions, as in the
    reference; the caller drops the window positions afterwards).
    """
    k = keys.float()
    k = k / (k.norm(dim=-1, keepdim=True) + 1e-8)
    sim = k @ k.transpose(-1, -2)
    sim.diagonal(dim1=-2, dim2=-1).zero_()
    length = sim.shape[-1]
    pos = torch.arange(length, device=sim.device, dtype=torch.int32)
    last_similar = torch.where(sim > threshold, pos, 0).amax(dim=-1, keepdim=True)
    sim.scatter_(-1, last_similar.long(), 0.0)
    return sim.mean(dim=-2).softmax(dim=-1)


def rkv_scores(keys: Tensor, queries: Tensor, *, lam: float = 0.1, kernel: int = 7,
               threshold: float = 0.5) -> Tensor:
    """R-KV score lam * importance - (1 - lam) * redundancy over the past positions."""
    red = redundancy(keys, threshold=threshold)[..., :-OBSERVATION_WINDOW]
    return lam * importance(keys, queries, kernel=kernel) - (1 - lam) * red


def snapkv_scores(keys: Tensor, queries: Tensor, *, kernel: int = 7) -> Tensor:
    """Decode-time SnapKV: R-KV without the redundancy term."""
    return importance(keys, queries, kernel=kernel)


def tova_scores(keys: Tensor, queries: Tensor) -> Tensor:
    """TOVA (Oren et al. 2024): the `past_attention` of the newest query alone, fp32, [..., H_kv, L - OBSERVATION_WINDOW]
    (its query group combined as for R-KV)."""
    return past_attention(keys, queries[..., -1:, :])[..., 0, :]


def streaming_scores(length: int, *, sink: int = 4, device: torch.device | str = "cpu") -> Tensor:
    """StreamingLLM as a score: the ``sink`` first positions first, then by recency, [length - OBSERVATION_WINDOW]."""
    score = torch.arange(length - OBSERVATION_WINDOW, device=device, dtype=torch.float32)
    score[:sink] = math.inf
    return score


def keep_top(scores: Tensor, budget: int) -> Tensor:
    """Top ``budget - OBSERVATION_WINDOW`` past positions by score (ties: earlier first) plus the last OBSERVATION_WINDOW, ascending."""
    past = scores.shape[-1]
    if not OBSERVATION_WINDOW < budget <= past + OBSERVATION_WINDOW:
        raise ValueError(f"budget {budget} must be in ({OBSERVATION_WINDOW}, {past + OBSERVATION_WINDOW}]")
    order = torch.sort(scores, dim=-1, descending=True, stable=True).indices[..., : budget - OBSERVATION_WINDOW]
    window = torch.arange(past, past + OBSERVATION_WINDOW, device=scores.device).expand(*scores.shape[:-1], OBSERVATION_WINDOW)
    return torch.cat([order, window], dim=-1).sort(dim=-1).values


def rkv_keep(keys: Tensor, queries: Tensor, budget: int, *, lam: float = 0.1, kernel: int = 7,
             threshold: float = 0.5) -> Tensor:
    """Positions R-KV keeps per KV head, [..., H_kv, budget], ascending."""
    return keep_top(rkv_scores(keys, queries, lam=lam, kernel=kernel, threshold=threshold), budget)


def snapkv_keep(keys: Tensor, queries: Tensor, budget: int, *, kernel: int = 7) -> Tensor:
    """Positions SnapKV keeps per KV head, [..., H_kv, budget], ascending."""
    return keep_top(snapkv_scores(keys, queries, kernel=kernel), budget)


def streaming_keep(length: int, budget: int, *, sink: int = 4) -> Tensor:
    """Positions StreamingLLM keeps: the first ``sink`` and the last ``budget - sink``, [budget]."""
    if not sink + OBSERVATION_WINDOW <= budget < length:
        raise ValueError(f"need {sink + OBSERVATION_WINDOW} <= budget {budget} < length {length}")
    return keep_top(streaming_scores(length, sink=sink), budget)


@dataclass(frozen=True)
class Evictor:
    """One policy, kvpress style: `score(keys, queries)` ranks the past positions [..., H_kv, L - OBSERVATION_WINDOW]
    (higher is kept); `keep_top` and the bounded cache around it are shared by all."""

    name: str
    description: str
    score: Callable[[Tensor, Tensor], Tensor]


def _streaming(keys: Tensor, queries: Tensor) -> Tensor:
    length = keys.shape[-2]
    return streaming_scores(length, device=keys.device).expand(*keys.shape[:-2], length - OBSERVATION_WINDOW)


EVICTORS: dict[str, Evictor] = {e.name: e for e in (
    Evictor("rkv", "R-KV (Cai et al. 2025): attention importance minus key redundancy", rkv_scores),
    Evictor("snapkv", "SnapKV (Li et al. 2024) at decode time: attention importance alone", snapkv_scores),
    Evictor("streaming", "StreamingLLM (Xiao et al. 2023): the 4 first positions (attention sinks) and the most recent", _streaming),
    Evictor("tova", "TOVA (Oren et al. 2024): the newest query's attention alone", tova_scores),
)}
NO_EVICTION = "none"  # `--evictor none`: the base keeps a full cache (no evictor runs)
CHOICES = (*EVICTORS, NO_EVICTION)


def keep_positions(evictor: str, keys: Tensor, queries: Tensor, budget: int) -> Tensor:
    """Kept positions [..., H_kv, budget] under a named policy with its default settings."""
    if evictor not in EVICTORS:
        raise ValueError(f"policy {evictor!r} does not compress; choose one of {tuple(EVICTORS)}")
    return keep_top(EVICTORS[evictor].score(keys, queries), budget)


def gather_positions(x: Tensor, kept: Tensor) -> Tensor:
    """Select positions along dim -2: x [..., H, L, D], kept [..., H, B] -> [..., H, B, D]."""
    return x.gather(-2, kept.unsqueeze(-1).expand(*kept.shape, x.shape[-1]))
