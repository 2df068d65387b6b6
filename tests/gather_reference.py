"""The full cache's former attention, kept as the reference of its paged and cascade attention: every row's
blocks gathered into one tensor padded to the longest row, then masked attention (`attend_padded`)."""

import torch

from kvrescue_cli.engine.attention import attend_padded
from kvrescue_cli.engine.caches import FullCache


def gather_attend(cache: FullCache, layer: int, rows: list[int], kv_lengths: list[int],
                  q: torch.Tensor) -> torch.Tensor:
    """Attention of q [R, Hq, T, D] (the new tokens of `rows`, already written to the cache, which held
    kv_lengths[i] tokens of rows[i] before them) over each row's blocks, gathered."""
    R, _, T, D = q.shape
    blocks = [cache.rows[r].blocks for r in rows]
    widest = max(len(b) for b in blocks)
    ids = torch.tensor([b + [0] * (widest - len(b)) for b in blocks], device=q.device).flatten()
    heads_dim = cache.k.shape[3:]
    k = cache.k[layer].index_select(0, ids).view(R, -1, *heads_dim).transpose(1, 2)
    v = cache.v[layer].index_select(0, ids).view(R, -1, *heads_dim).transpose(1, 2)
    cached = torch.tensor(kv_lengths, device=q.device)
    added = torch.tensor([cache.length(r) for r in rows], device=q.device) - cached
    return attend_padded(q, k, v, cached, added)
