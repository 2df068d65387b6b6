"""References of the full cache's paged and cascade attention: its former attention (every row's blocks gathered
into one tensor padded to the longest row, then masked attention, `attend_padded`), and exact attention (float64,
row by row, an explicit softmax: no fused kernel, no paging)."""

import torch

from kvrescue.engine.attention import attend_padded
from kvrescue.engine.caches import FullCache


def gather_attend(cache: FullCache, layer: int, rows: list[int], kv_lengths: list[int],
                  q: torch.Tensor) -> torch.Tensor:
    """Attention of q [R, Hq, T, D] (the new tokens of `rows`, already written to the cache, which held
    kv_lengths[i] tokens of rows[i] before them) over each row's blocks, gathered."""
    R, _, T, D = q.shape
    blocks = [cache.blocks(r) for r in rows]
    widest = max(len(b) for b in blocks)
    ids = torch.tensor([b + [0] * (widest - len(b)) for b in blocks], device=q.device).flatten()
    heads_dim = cache.k.shape[3:]
    k = cache.k[layer].index_select(0, ids).view(R, -1, *heads_dim).transpose(1, 2)
    v = cache.v[layer].index_select(0, ids).view(R, -1, *heads_dim).transpose(1, 2)
    cached = torch.tensor(kv_lengths, device=q.device)
    added = torch.tensor([cache.length(r) for r in rows], device=q.device) - cached
    return attend_padded(q, k, v, cached, added)


def exact_attend(cache: FullCache, layer: int, rows: list[int], kv_lengths: list[int], q: torch.Tensor) -> torch.Tensor:
    """The same attention in float64 (as `gather_attend`'s arguments), [R, Hq, T, D]; queries past a row's new
    tokens are left 0. Query head h uses KV head h // g; new token t sees the cached keys and new keys 0..t."""
    R, Hq, T, D = q.shape
    out = torch.zeros(R, Hq, T, D, dtype=torch.float64)
    for i, (row, cached) in enumerate(zip(rows, kv_lengths)):
        n = cache.length(row)
        blocks = torch.tensor(cache.blocks(row))
        g = Hq // cache.k.shape[3]
        k, v = (pool[layer, blocks].flatten(0, 1)[:n].double().repeat_interleave(g, dim=1).transpose(0, 1)
                for pool in (cache.k, cache.v))  # [Hq, n, D]
        scores = q[i, :, : n - cached].double() @ k.transpose(1, 2) / D**0.5  # [Hq, new, n]
        visible = torch.arange(n)[None, :] <= cached + torch.arange(n - cached)[:, None]
        out[i, :, : n - cached] = scores.masked_fill(~visible, float("-inf")).softmax(-1) @ v
    return out
