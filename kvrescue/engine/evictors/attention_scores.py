"""The scores several evictors share: the window queries' attention over the past keys (SnapKV, R-KV, TOVA, and so
PyramidKV and Ada-KV) and R-KV's key redundancy. Shapes as in `base`."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from kvrescue.shapes import OBSERVATION_WINDOW, SIMILARITY_ROWS


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
    reference; the caller drops the window positions afterwards). S is computed SIMILARITY_ROWS rows at a
    time (their column sums added in order), so a long row's scoring holds SIMILARITY_ROWS x L, not L x L.
    """
    k = keys.float()
    k = k / (k.norm(dim=-1, keepdim=True) + 1e-8)
    length = k.shape[-2]
    pos = torch.arange(length, device=k.device, dtype=torch.int32)
    total = None
    for start in range(0, length, SIMILARITY_ROWS):
        sim = k[..., start : start + SIMILARITY_ROWS, :] @ k.transpose(-1, -2)  # rows i of S, all columns j
        sim.diagonal(offset=start, dim1=-2, dim2=-1).zero_()
        last_similar = torch.where(sim > threshold, pos, 0).amax(dim=-1, keepdim=True)
        sim.scatter_(-1, last_similar.long(), 0.0)
        total = sim.sum(dim=-2) if total is None else total.add_(sim.sum(dim=-2))
    return (total / length).softmax(dim=-1)
