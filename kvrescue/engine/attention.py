"""Attention kernels shared by the caches: masked attention over padded rows, and attention over a block
table (paged, with the log-sum-exp that lets partial results over disjoint key sets be merged exactly)."""

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

import kvrescue.engine.flex as flex
import kvrescue.engine.invariance as invariance
from kvrescue.shapes import CHUNK_TOKENS, FLASH_BLOCK, QUERY_GROUP, SCORE_BYTES

try:
    from flash_attn import flash_attn_with_kvcache
except ImportError:
    flash_attn_with_kvcache = None

# A forward on the torch path reads each row's blocks padded to the longest row's (one fused attention per layer, a few
# torch calls instead of the chunks' ~30) when that reads at most this many times the chunks' blocks.
ROWS_PADDING = 1.5


def use_flash(x: torch.Tensor) -> bool:
    """flash-attn serves half-precision tensors on a GPU when it is installed."""
    return flash_attn_with_kvcache is not None and x.is_cuda and x.dtype in (torch.float16, torch.bfloat16)


def padded_visibility(kv_lengths: torch.Tensor, new_lengths: torch.Tensor, queries: int, keys: int) -> torch.Tensor:
    """The mask of `attend_padded` [R, queries, keys]: row r holds kv_lengths[r] cached keys, then its
    new_lengths[r] new ones (the queries' own) right after them, then padding; key j is visible to new token t
    when it is cached or an earlier/same new token and not padding. A padded query (t >= new_lengths[r]) sees key
    0 at least, so that its softmax stays finite. Computed once per forward, read by every layer."""
    t = torch.arange(queries, device=kv_lengths.device)
    j = torch.arange(keys, device=kv_lengths.device)
    start = kv_lengths[:, None, None]
    total = (kv_lengths + new_lengths)[:, None, None]
    mask = (j[None, None, :] <= start + t[None, :, None]) & (j[None, None, :] < total)
    mask[:, :, 0] = True
    return mask


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
    return attend_masked(q, k, v, padded_visibility(kv_lengths, new_lengths, q.shape[2], k.shape[2]))


def _grouped_mask(mask: torch.Tensor, q_shape: torch.Size | tuple[int, ...], kv_heads: int) -> torch.Tensor:
    """GQA without repeating K/V: the g query heads sharing KV head j (heads j*g .. j*g+g-1, as in Hugging Face's
    repeat_kv) become g*T query rows of one attention over head j (q [R, Hq, T, D] as [R, Hkv, g*T, D]). Returns the
    mask of q's keys, [R, T, L] or [R, 1, L] (alike for every query), or [R, Hkv, T or 1, L] (each KV head its own),
    repeated for those rows: [R, 1 or Hkv, g*T, L]."""
    R, Hq, T, _ = q_shape
    g, L = Hq // kv_heads, mask.shape[-1]
    per_head = mask if mask.dim() == 4 else mask[:, None]
    heads = per_head.shape[1]
    return per_head[:, :, None].expand(R, heads, g, T, L).reshape(R, heads, g * T, L)


class Visibility:
    """A mask of `attend_masked` built once per forward and read by every layer, laid out for the queries (SDPA's
    additive bias over the grouped queries, `_grouped_mask`, or with batch invariance on `invariance.attend_tokens`')
    by the first layer that reads it, for all of them (their queries alike in shape and dtype)."""

    def __init__(self, visible: torch.Tensor, grouped: bool = True) -> None:
        """`grouped`: the bias laid out for the grouped queries (held for the forward: g times the mask where each
        query has its own row); else the mask's own bias, which each layer lays out for its queries
        (`attend_biased` on a CPU: a copy while the layer attends)."""
        self.visible, self.grouped = visible, grouped
        self.bias: torch.Tensor | None = None

    def bias_for(self, q: torch.Tensor, kv_heads: int) -> torch.Tensor:
        if self.bias is None:  # the bias of the mask, then laid out (a view where one row of it serves every query)
            bias = visibility_bias(self.visible, q.dtype)
            grouped = self.grouped and not invariance.active(q)
            self.bias = _grouped_mask(bias, q.shape, kv_heads) if grouped else bias
        return self.bias


def attend_masked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  visible: torch.Tensor | Visibility) -> torch.Tensor:
    """Attention of q [R, Hq, T, D] over k, v [R, Hkv, L, D] (Hq a multiple of Hkv), key l visible to query t of
    row r where visible[r, t, l] (or visible[r, j, t, l] for KV head j; bool; every query must see a key), or as a
    `Visibility` that every layer reads. Returns [R, Hq, T, D], in whatever layout the kernel chose (CUDA's
    memory-efficient kernel lays [R, Hkv, gT, D] out as [R, gT, Hkv, D]: a copy then).
    With batch invariance on (L whole KEY_GRANULE blocks), each query token as a decode step."""
    bias = (visible if isinstance(visible, Visibility) else Visibility(visible)).bias_for(q, k.shape[1])
    if invariance.active(q):
        return invariance.attend_tokens(q, k, v, bias)[0]
    qg = q.reshape(q.shape[0], k.shape[1], -1, q.shape[3])
    return F.scaled_dot_product_attention(qg, k, v, attn_mask=bias).reshape(q.shape)


def visibility_bias(visible: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The additive mask of SDPA: 0 where `visible`, else -inf."""
    return torch.full(visible.shape, float("-inf"), dtype=dtype, device=visible.device).masked_fill_(visible, 0.0)


def attend_biased(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  visible: Visibility) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`attend_masked`, with the log-sum-exp [R, Hq, T] (fp32) of each query's scaled scores on a CPU: SDPA's CPU
    flash kernel, which computes it anyway (elsewhere None: SDPA's kernels there do not return it). With batch
    invariance on (L whole KEY_GRANULE blocks), each query token as a decode step."""
    if not q.is_cpu:
        return attend_masked(q, k, v, visible), None
    bias = visible.bias_for(q, k.shape[1])
    if invariance.active(q):
        return invariance.attend_tokens(q, k, v, bias)
    qg = q.reshape(q.shape[0], k.shape[1], -1, q.shape[3])
    grouped = bias if visible.grouped else _grouped_mask(bias, q.shape, k.shape[1])
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(qg, k, v, attn_mask=grouped)
    return out.reshape(q.shape), lse.reshape(q.shape[:3])


@dataclass
class PagedKeys:
    """Where S sequences' keys lie in pool blocks, for `attend_paged`; built once per forward (`paged_keys`)
    and read by every layer. flash-attn reads `table` in place, FlexAttention through `flex`; the torch path reads
    chunks of whole blocks, or each row's blocks padded to the longest row's (`visible` set, `owner` None)."""

    table: torch.Tensor  # [S, W] sequence s's key j is in block table[s, j // block_size] (past its keys: any id)
    cached: torch.Tensor  # [S] cached keys of each sequence
    causal: bool  # the queries are each sequence's last keys (else they see exactly the cached keys)
    blocks: torch.Tensor | None = None  # torch path: the blocks of every chunk read, chunk after chunk; None: flash
    owner: torch.Tensor | None = None  # [P] the sequence of each chunk
    hidden: torch.Tensor | None = None  # [P, T, L] key l of chunk p is invisible to query t of its sequence
    visible: Visibility | None = None  # whole rows: [S, T or 1, L] key l of sequence s visible to query t
    flex: "flex.PagedSteps | None" = None  # FlexAttention's block mask: causal queries, the pools read in place


def flash_reads(k_pool: torch.Tensor) -> bool:
    """Whether flash-attn's paged kernel reads pools like `k_pool` (FLASH_BLOCK-token blocks)."""
    return use_flash(k_pool) and k_pool.shape[1] % FLASH_BLOCK == 0


def reader(k_pool: torch.Tensor, queries: int, causal: bool, rows: int) -> str:
    """The kernel that reads the keys of `rows` sequences with `queries` queries each in pools like `k_pool`: "flash"
    (`flash_reads`), "flex" (FlexAttention in place: causal queries, a decode step's one a sequence or a forward's
    several, `flex.serves`), else "torch"."""
    if flash_reads(k_pool):
        return "flash"
    return "flex" if causal and flex.serves(k_pool, queries, rows) else "torch"


def paged_layout(k_pool: torch.Tensor, table: np.ndarray, cached: np.ndarray, queries: int,
                 causal: bool, rows_padding: float = ROWS_PADDING, merged: bool = False) -> dict[str, np.ndarray]:
    """The host half of `paged_keys`: where S sequences' keys lie, from host arrays (table [S, W] of block ids,
    cached [S]); for the torch path also the blocks it reads: the chunks of whole blocks of each sequence (owner
    and index of every chunk, and its blocks), or, when it costs at most `rows_padding` times the chunks' reads,
    every sequence's blocks padded to the longest's: one SDPA, its mask laid out once per forward (off a CPU only
    where that mask fits SCORE_BYTES, the results are not `merged` by their log-sum-exp, which SDPA's kernels there do
    not return, and batch invariance is off: the padding follows the batch). With batch invariance on a CPU, always
    whole rows, to whole KEY_GRANULE blocks (block ids past a table's end are 0). Where flash-attn or FlexAttention
    reads the keys (`reader`): the table alone, read in place. Send the arrays to the device (`transfer.upload_all`)
    and build the keys there with `paged_keys`: nothing waits for the device."""
    layout = {"table": table, "cached": cached}
    if reader(k_pool, queries, causal, len(cached)) != "torch":
        return layout
    block_size = k_pool.shape[1]
    per_chunk = max(1, CHUNK_TOKENS // block_size)
    n_chunks = -(-(cached + queries * causal) // (per_chunk * block_size))
    width = int((-(-(cached + queries * causal) // block_size)).max())
    if invariance.active(k_pool):
        width = invariance.padded_keys(width * block_size) // block_size
        whole = np.zeros((table.shape[0], width), table.dtype)
        whole[:, : min(width, table.shape[1])] = table[:, :width]
        return {**layout, "blocks": whole.ravel()}
    mask_bytes = len(cached) * QUERY_GROUP * (queries if causal else 1) * width * block_size * k_pool.element_size()
    masked = k_pool.is_cpu or (not merged and not invariance.on() and mask_bytes <= SCORE_BYTES)
    if masked and len(cached) * width <= rows_padding * n_chunks.sum() * per_chunk:
        return {**layout, "blocks": table[:, :width].ravel()}
    width = -(-table.shape[1] // per_chunk) * per_chunk
    chunks = np.zeros((table.shape[0], width), table.dtype)  # the table padded to whole chunks
    chunks[:, : table.shape[1]] = table
    chunks = chunks.reshape(table.shape[0], -1, per_chunk)
    owner, index = np.nonzero(np.arange(chunks.shape[1]) < n_chunks[:, None])
    return {**layout, "blocks": chunks[owner, index].ravel(), "owner": owner, "index": index}


def paged_keys(k_pool: torch.Tensor, layout: dict[str, torch.Tensor], queries: int, causal: bool) -> PagedKeys:
    """The keys of S sequences with `queries` queries each, in pools like `k_pool` [blocks, block_size, Hkv, D]
    (flash_attn_with_kvcache's semantics), from `paged_layout`'s arrays on the device. Causal: sequence s has
    cached[s] + queries keys and query t sees keys 0..cached[s] + t (the last `queries` keys are the queries'
    own). Not causal: every query sees keys 0..cached[s] - 1. flash-attn serves FLASH_BLOCK-token blocks;
    other sizes take the torch path; FlexAttention, where `paged_layout` chose it, reads the table in place."""
    table, cached = layout["table"], layout["cached"]
    if reader(k_pool, queries, causal, cached.shape[0]) == "flex":
        steps = flex.PagedSteps(table, cached, k_pool.shape[0], k_pool.shape[1], queries)
        return PagedKeys(table, cached, causal, flex=steps)
    if "blocks" not in layout:
        return PagedKeys(table, cached, causal)
    if "owner" not in layout:  # whole rows
        position = torch.arange(layout["blocks"].shape[0] // len(cached) * k_pool.shape[1], device=table.device)
        if causal:
            horizon = cached[:, None] + torch.arange(queries, device=table.device)  # [S, T]
            visible = position[None, None, :] <= horizon[:, :, None]
        else:
            visible = (position[None, :] < cached[:, None])[:, None, :]  # alike for every query
        # On a CPU each layer lays the bias out for its queries: a copy held only while it attends, not the forward
        return PagedKeys(table, cached, causal, layout["blocks"], visible=Visibility(visible, not k_pool.is_cpu))
    owner, index = layout["owner"], layout["index"]
    L = max(1, CHUNK_TOKENS // k_pool.shape[1]) * k_pool.shape[1]
    position = index[:, None] * L + torch.arange(L, device=table.device)  # [P, L]
    if causal:
        horizon = cached.index_select(0, owner)[:, None] + torch.arange(queries, device=table.device)  # [P, T]
        hidden = position[:, None, :] > horizon[:, :, None]
    else:
        hidden = (position >= cached.index_select(0, owner)[:, None])[:, None, :].expand(-1, queries, -1)
    return PagedKeys(table, cached, causal, layout["blocks"], owner, hidden)


def attend_paged(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                 keys: PagedKeys) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of S sequences' queries q [S, Hq, T, D] over their keys in pools [blocks, block_size, Hkv, D]
    (Hq a multiple of Hkv), read through the block table (in chunks: with no padding to the longest sequence).
    Returns out [S, Hq, T, D] and lse [S, Hq, T] (fp32 log of each query's softmax denominator), so that
    results over disjoint key sets merge exactly (`merge_partials`)."""
    if keys.flex is not None:
        return keys.flex.attend(q, k_pool, v_pool)
    if keys.blocks is None:
        out, lse = flash_attn_with_kvcache(
            q.transpose(1, 2), k_pool, v_pool, cache_seqlens=(keys.cached + q.shape[2] * keys.causal).int(),
            block_table=keys.table.int(), causal=keys.causal, return_softmax_lse=True,
            num_splits=invariance.flash_splits(),
        )
        return out.transpose(1, 2), lse
    S, Hq, T, D = q.shape
    Hkv = k_pool.shape[2]
    P, L = (S, keys.visible.visible.shape[2]) if keys.owner is None else (keys.hidden.shape[0], keys.hidden.shape[2])
    k, v = (pool.index_select(0, keys.blocks).view(P, L, Hkv, D).transpose(1, 2) for pool in (k_pool, v_pool))
    if keys.owner is None:  # SDPA reads the strided heads as they are
        return attend_biased(q, k, v, keys.visible)
    # Head-major copies [P, Hkv, L, D]: one batched matmul over all KV heads reads them contiguously.
    k, v = k.contiguous(), v.contiguous()
    # GQA: the g query heads of KV head j (heads j*g .. j*g+g-1) attend together over head j.
    qg = q.view(S, Hkv, Hq // Hkv, T, D) * D**-0.5
    step = max(1, SCORE_BYTES // (4 * P * Hq * L))  # queries per slice
    parts = [_softmax_over_chunks(qg[:, :, :, t : t + step], k, v, keys.owner, keys.hidden[:, t : t + step])
             for t in range(0, T, step)]
    out, lse = parts[0] if len(parts) == 1 else (torch.cat(p, dim=3) for p in zip(*parts))
    return out.reshape(S, Hq, T, D).to(q.dtype), lse.reshape(S, Hq, T)


def merge_partials(
    out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
) -> torch.Tensor:
    """Attention over the union of two disjoint key sets from the results over each (the split-softmax
    merge): out [..., D] and lse [...] per part. Each query needs a key in at least one part."""
    lse = torch.logaddexp(lse_a, lse_b)
    a, b = (lse_a - lse).exp()[..., None], (lse_b - lse).exp()[..., None]
    return (out_a * a + out_b * b).to(out_a.dtype)


def _softmax_over_chunks(q, keys, values, owner, hidden):
    """q [S, Hkv, g, T, D] (pre-scaled) over chunk p's keys and values [P, Hkv, L, D] for sequence owner[p],
    key l of chunk p hidden from query t where hidden[p, t, l]. Returns out [S, Hkv, g, T, D] and lse
    [S, Hkv, g, T] (fp32)."""
    S, Hkv, g, T, D = q.shape
    P, L = hidden.shape[0], hidden.shape[2]
    q = q.index_select(0, owner).view(P, Hkv, g * T, D)
    scores = (q @ keys.transpose(2, 3)).float()  # [P, Hkv, gT, L]
    scores.view(P, Hkv, g, T, L).masked_fill_(hidden[:, None, None], float("-inf"))
    chunk_peak = scores.amax(-1)
    peak = scores.new_full((S, Hkv, g * T), float("-inf"))
    peak.scatter_reduce_(0, owner[:, None, None].expand_as(chunk_peak), chunk_peak, "amax")
    peak = peak.nan_to_num(neginf=0.0)  # a query with no visible key: its sums stay 0
    weights = (scores - peak.index_select(0, owner)[..., None]).exp_()
    total = scores.new_zeros(S, Hkv, g * T).index_add_(0, owner, weights.sum(-1))
    weights = weights.to(values.dtype)
    mixed = (weights @ values).float()  # [P, Hkv, gT, D]
    out = scores.new_zeros(S, Hkv, g * T, D).index_add_(0, owner, mixed)
    out = out / total.clamp_min(torch.finfo(total.dtype).tiny)[..., None]
    return out.view(S, Hkv, g, T, D), (peak + total.log()).view(S, Hkv, g, T)
