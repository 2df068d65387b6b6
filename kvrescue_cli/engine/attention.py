"""Attention kernels shared by the caches: masked attention over padded rows, and attention over a block
table (paged, with the log-sum-exp that lets partial results over disjoint key sets be merged exactly)."""

import torch
import torch.nn.functional as F

try:
    from flash_attn import flash_attn_with_kvcache
except ImportError:
    flash_attn_with_kvcache = None

FLASH_BLOCK = 256  # flash-attn's paged KV cache takes blocks of a multiple of 256 tokens
CHUNK_TOKENS = 128  # keys per unit of work of the torch paged path (whole blocks)
SCORE_BYTES = 1 << 28  # bound on the fp32 scores of one torch paged call; longer query sets are sliced


def use_flash(x: torch.Tensor) -> bool:
    """flash-attn serves half-precision tensors on a GPU when it is installed."""
    return flash_attn_with_kvcache is not None and x.is_cuda and x.dtype in (torch.float16, torch.bfloat16)


def attend_padded(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_lengths: torch.Tensor,
    new_lengths: torch.Tensor,
) -> torch.Tensor:
    """Attention of new tokens over each row's cached keys and, causally, over the new ones.

    q: [R, Hq, T, D], the new tokens' queries (right padded to T).
    k, v: [R, Hkv, L, D]; row r holds its kv_lengths[r] cached keys at 0..kv_lengths[r]-1, then its
    new_lengths[r] new keys right after them, then padding (any values). Hq must be a multiple of Hkv.
    kv_lengths, new_lengths: LongTensor [R] on q's device.
    Returns [R, Hq, T, D]; outputs at padded query positions are finite and meaningless.
    """
    t = torch.arange(q.shape[2], device=q.device)
    j = torch.arange(k.shape[2], device=q.device)
    start = kv_lengths[:, None, None]
    total = (kv_lengths + new_lengths)[:, None, None]
    # Key j is visible to new token t when it is cached or an earlier/same new token and not padding.
    mask = (j[None, None, :] <= start + t[None, :, None]) & (j[None, None, :] < total)
    # A padded query row (t >= new_lengths) may see no key at all; give it key 0 so softmax stays finite.
    mask[:, :, 0] = True
    R, Hq, T, D = q.shape
    Hkv, L = k.shape[1], k.shape[2]
    g = Hq // Hkv
    # GQA without repeating K/V: the g query heads sharing KV head j (heads j*g .. j*g+g-1, as in
    # Hugging Face's repeat_kv) become g*T query rows of one attention over head j.
    qg = q.reshape(R, Hkv, g * T, D)
    mask = mask[:, None, None].expand(R, 1, g, T, L).reshape(R, 1, g * T, L)
    return F.scaled_dot_product_attention(qg, k, v, attn_mask=mask).view(R, Hq, T, D)


def attend_paged(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    table: torch.Tensor,
    cached: torch.Tensor,
    causal: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of S sequences' queries over keys read in place from pool blocks through a block table
    (flash_attn_with_kvcache's semantics), with no padding of the keys to the longest sequence.

    q: [S, Hq, T, D]. k_pool, v_pool: [blocks, block_size, Hkv, D]; Hq a multiple of Hkv.
    table: LongTensor [S, W]: sequence s's key j lives in block table[s, j // block_size] at offset
    j % block_size; entries past its keys may hold any block id.
    cached: LongTensor [S]. Causal: sequence s has cached[s] + T keys and query t sees keys
    0..cached[s] + t (the last T keys are the queries' own). Not causal: every query sees keys 0..cached[s] - 1.
    Returns out [S, Hq, T, D] and lse [S, Hq, T] (fp32 log of each query's softmax denominator), so that
    results over disjoint key sets merge exactly (`merge_partials`). flash-attn serves pools of
    FLASH_BLOCK-token blocks; other block sizes take the torch path.
    """
    if use_flash(q) and k_pool.shape[1] % FLASH_BLOCK == 0:
        out, lse = flash_attn_with_kvcache(
            q.transpose(1, 2), k_pool, v_pool, cache_seqlens=(cached + q.shape[2] * causal).int(),
            block_table=table.int(), causal=causal, return_softmax_lse=True,
        )
        return out.transpose(1, 2), lse
    return _attend_paged_torch(q, k_pool, v_pool, table, cached, causal)


def merge_partials(
    out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
) -> torch.Tensor:
    """Attention over the union of two disjoint key sets from the results over each (the split-softmax
    merge): out [..., D] and lse [...] per part. Each query needs a key in at least one part."""
    lse = torch.logaddexp(lse_a, lse_b)
    a, b = (lse_a - lse).exp()[..., None], (lse_b - lse).exp()[..., None]
    return (out_a * a + out_b * b).to(out_a.dtype)


def _attend_paged_torch(q, k_pool, v_pool, table, cached, causal):
    """`attend_paged` in torch: the keys are cut into chunks of CHUNK_TOKENS (whole blocks), only the
    chunks that hold a sequence's keys are read, and the softmax runs over each sequence's chunks."""
    S, Hq, T, D = q.shape
    block_size, Hkv = k_pool.shape[1], k_pool.shape[2]
    g = Hq // Hkv
    per_chunk = max(1, CHUNK_TOKENS // block_size)
    lengths = cached + T if causal else cached
    n_chunks = -(-lengths // (per_chunk * block_size))
    width = -(-table.shape[1] // per_chunk) * per_chunk
    chunks = F.pad(table, (0, width - table.shape[1])).view(S, -1, per_chunk)
    owner, index = (torch.arange(chunks.shape[1], device=q.device)[None, :] < n_chunks[:, None]).nonzero(as_tuple=True)
    blocks = chunks[owner, index].flatten()
    L = per_chunk * block_size
    keys = k_pool.index_select(0, blocks).view(-1, L, Hkv, D)
    values = v_pool.index_select(0, blocks).view(-1, L, Hkv, D)
    position = index[:, None] * L + torch.arange(L, device=q.device)  # [P, L]
    t = torch.arange(T, device=q.device)
    horizon = cached[:, None] + t if causal else (cached - 1)[:, None].expand(S, T)  # last key each query sees
    # GQA: the g query heads of KV head j become g*T query rows over head j, as in `attend_padded`.
    qg = q.reshape(S, Hkv, g * T, D) * D**-0.5
    horizon = horizon[:, None].expand(S, g, T).reshape(S, g * T)
    P = blocks.numel() // per_chunk
    step = max(1, SCORE_BYTES // max(1, 4 * P * Hkv * L))
    parts = [
        _softmax_over_chunks(qg[:, :, m : m + step], keys, values, owner, position, horizon[:, m : m + step])
        for m in range(0, g * T, step)
    ]
    out = torch.cat([p[0] for p in parts], dim=2).view(S, Hq, T, D)
    return out.to(q.dtype), torch.cat([p[1] for p in parts], dim=2).view(S, Hq, T)


def _softmax_over_chunks(q, keys, values, owner, position, horizon):
    """q [S, Hkv, M, D] (pre-scaled) over chunk p's keys and values [P, L, Hkv, D] for sequence owner[p];
    key l of chunk p is at position[p, l], visible to query m of its sequence up to horizon[s, m].
    Returns out [S, Hkv, M, D] and lse [S, Hkv, M] (fp32)."""
    S, Hkv, M, D = q.shape
    q = q.index_select(0, owner)
    # One matmul per KV head: a head's keys are a strided matrix BLAS reads as is (a 4-d matmul would copy them).
    scores = torch.stack([q[:, h] @ keys[:, :, h].transpose(1, 2) for h in range(Hkv)], 1).float()  # [P, Hkv, M, L]
    hidden = position[:, None, :] > horizon.index_select(0, owner)[:, :, None]  # [P, M, L]
    scores.masked_fill_(hidden[:, None], float("-inf"))
    chunk_peak = scores.amax(-1)
    peak = scores.new_full((S, Hkv, M), float("-inf"))
    peak.scatter_reduce_(0, owner[:, None, None].expand_as(chunk_peak), chunk_peak, "amax")
    peak = peak.nan_to_num(neginf=0.0)  # a query with no visible key: its sums stay 0
    weights = (scores - peak.index_select(0, owner)[..., None]).exp_()
    total = scores.new_zeros(S, Hkv, M).index_add_(0, owner, weights.sum(-1))
    weights = weights.to(values.dtype)
    mixed = torch.stack([weights[:, h] @ values[:, :, h] for h in range(Hkv)], 1).float()  # [P, Hkv, M, D]
    out = scores.new_zeros(S, Hkv, M, D).index_add_(0, owner, mixed)
    return out / total.clamp_min(torch.finfo(total.dtype).tiny)[..., None], peak + total.log()
