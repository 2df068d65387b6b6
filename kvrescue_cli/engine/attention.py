"""Masked attention over padded rows, shared by every cache implementation."""

import torch
import torch.nn.functional as F


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
