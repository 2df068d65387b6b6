"""Attention over the caches' pools in place, with PyTorch's FlexAttention: a block mask names the blocks each row
reads and a mask function what it sees of them, so no row's keys are gathered and copied before the kernel reads them.

On CUDA with Triton, where flash-attn does not serve, it is compiled (Triton kernels, no other dependency) and serves
the one-token steps, eager and static: the full cache's (paged, as `torch.nn.attention.experimental._paged_attention`
lays a pool out) and the bounded cache's (each slot its own batch entry); and a full cache's forwards of several tokens
a row over cached keys (the PRM's scoring, commits, later prefills), causal among the new tokens. Elsewhere SDPA
serves; `SERVES` forces the choice (the tests, gpu_check's comparison; a user, with KVRESCUE_FLEX=0 or 1 in the
environment). Off CUDA, FlexAttention runs eagerly: PyTorch's reference implementation, which scores every key of the
pool; the tests check the block masks and mask functions with it.
"""

from __future__ import annotations

import functools
import os
import sys

import torch

import kvrescue.engine.invariance as invariance
from kvrescue.shapes import bucket

try:
    from torch.nn.attention.flex_attention import AuxRequest, BlockMask, flex_attention
except ImportError:  # a torch without FlexAttention: SDPA serves
    flex_attention = None

# None: on CUDA with Triton; True/False: wherever FlexAttention exists / nowhere
SERVES: bool | None = {"1": True, "0": False}.get(os.environ.get("KVRESCUE_FLEX", ""))
QUERY_BLOCK = 128  # the block mask's least query tile (one tile a row: its queries all read the same blocks)
FORWARD_SHAPES = 32  # shapes of forwards of several tokens a row it serves in a process; a new one past them: SDPA
RECOMPILES = 64 + FORWARD_SHAPES  # shapes the compiled kernel is specialised for (row buckets x models x pools, and
# the forwards') before dynamo gives up (and would run the eager reference, which scores every key of the pool)
_forward_shapes: set[tuple] = set()


def serves(x: torch.Tensor, tokens: int = 1, rows: int = 1) -> bool:
    """Whether FlexAttention serves attention of `tokens` queries a row of `rows` rows over pools like `x` (not with
    batch invariance on: its split of the keys follows the batch). A forward of several tokens a row only in one of
    the first FORWARD_SHAPES shapes (rows and tokens bucketed, pools) it served in this process: the compiled kernel
    is specialised to each, and the later ones take SDPA."""
    if flex_attention is None or invariance.on() or SERVES is False:
        return False
    if SERVES is None:
        from torch._subclasses.fake_tensor import FakeTensor
        from torch.utils._triton import has_triton
        if not x.is_cuda or isinstance(x, FakeTensor) or not has_triton():  # fake tensors (a dry run) have no kernel
            return False
        if not runs_on(x.device, x.dtype, tokens > 1):
            return False
    if tokens == 1:
        return True
    shape = (tuple(x.shape), x.dtype, bucket(rows), bucket(tokens))
    if shape not in _forward_shapes and len(_forward_shapes) < FORWARD_SHAPES:
        _forward_shapes.add(shape)
    return shape in _forward_shapes


@functools.cache
def runs_on(device: torch.device, dtype: torch.dtype, several: bool = False) -> bool:
    """Whether the kernel runs on `device` in `dtype` and agrees with SDPA on a small paged decode step (`several`:
    forwards of 3 and 20 tokens a row, whose 7 x 4 and 7 x 32 folded queries take FlexAttention's decoding and main
    kernels): checked once a process and kind, on first use (before any capture: a static step warms up first). If
    not, one line on stderr says why and SDPA serves them."""
    return all(_agrees(device, dtype, tokens) for tokens in ((3, 20) if several else (1,)))


def _agrees(device: torch.device, dtype: torch.dtype, tokens: int) -> bool:
    """`runs_on` for a forward of `tokens` tokens a row over three rows' cached keys."""
    generator = torch.Generator(device).manual_seed(0)
    k_pool, v_pool = torch.randn(2, 8, 16, 2, 64, generator=generator, device=device).to(dtype)
    q = torch.randn(3, 14, tokens, 64, generator=generator, device=device).to(dtype)  # 7 query heads a KV head
    table = torch.tensor([[4, 1, 5], [4, 2, 6], [0, 3, 0]], device=device)
    cached = torch.tensor([20, 27, 3], device=device)
    try:
        got = PagedSteps(table, cached, 8, 16, tokens).attend(q, k_pool, v_pool)[0].float()
    except Exception as error:  # noqa: BLE001 (whatever the compiler raises: SDPA serves instead)
        print(f"kvrescue: FlexAttention does not run on {device} ({type(error).__name__}: {error}); SDPA serves",
              file=sys.stderr)
        return False
    causal = torch.ones(tokens, tokens, dtype=torch.bool, device=device).tril()
    for row, n in enumerate(cached.tolist()):
        keys, values = (pool[table[row]].flatten(0, 1)[:n + tokens].transpose(0, 1)[None] for pool in (k_pool, v_pool))
        visible = torch.cat([causal.new_ones(tokens, n), causal], 1)
        want = torch.nn.functional.scaled_dot_product_attention(q[row: row + 1], keys, values, visible, enable_gqa=True)
        if not torch.allclose(got[row: row + 1], want.float(), atol=2e-2, rtol=2e-2):
            print(f"kvrescue: FlexAttention disagrees with SDPA on {device} in {dtype}; SDPA serves", file=sys.stderr)
            return False
    return True


@functools.cache
def _compiled():
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILES)
    return torch.compile(flex_attention, dynamic=False)


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: BlockMask, lse: bool = False):
    """FlexAttention, compiled on CUDA, else eager. Inference only: detached inputs (a pool written outside
    inference mode requires grad, which FlexAttention refuses on a CPU). From QUERY_BLOCK queries a row the compiled
    kernel is the main one, whose key tile must divide the mask's key block (a pool block): at most 64 keys."""
    kernel, options = flex_attention, None
    if q.is_cuda:
        kernel = _compiled()
        if q.shape[2] >= QUERY_BLOCK:
            options = {"BLOCK_N": min(mask.BLOCK_SIZE[1], 64)}
    return kernel(q.detach(), k.detach(), v.detach(), block_mask=mask, kernel_options=options,
                  return_aux=AuxRequest(lse=True) if lse else None)


def _folded(q: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """T queries a row, q [R, Hq, T, D], as `group` = Hq / kv_heads x T queries of each KV head, [R, Hkv, group*T, D]
    (query heads j*group .. j*group+group-1 share KV head j; folded query i is token i % T): the kernel then reads each
    KV head's keys once for its group, whatever the group's size (its GQA path wants a power of two, which 7 of
    Qwen2.5-7B's query heads a KV head are not)."""
    R, Hq, T, D = q.shape
    return q.reshape(R, kv_heads, Hq // kv_heads * T, D)


def paged_mask(table: torch.Tensor, cached: torch.Tensor, pool_blocks: int, block_size: int, group: int,
               tokens: int = 1, new: torch.Tensor | None = None) -> BlockMask:
    """The block mask of `tokens` new tokens a sequence, `group` queries each (`_folded`), over a paged pool of
    `pool_blocks` blocks of `block_size` tokens: sequence s's key j lies in block table[s, j // block_size] (table
    [S, W], entries past its blocks any of its own or another's) and its token t sees keys 0 .. cached[s] + t (its
    cached keys, then the new tokens' own, stored before: causal among them). The kernel reads each sequence's blocks
    through the table, those holding keys 0 .. cached[s] + new[s] - 1 (`new` [S]: its valid new tokens, at least one;
    None: all `tokens`); the mask function maps a pool position back to the sequence's key index (the least index of
    its block in the table, W where it holds none) and hides what lies past the token's own. Every query sees key 0
    (padding tokens and rows too: their outputs finite and meaningless). The sequences are padded to a power of two
    (a compiled kernel serves few shapes); one query tile a sequence, QUERY_BLOCK or group x tokens rounded up to a
    power of two: all its queries read the same blocks."""
    padding = bucket(table.shape[0]) - table.shape[0]
    table = torch.nn.functional.pad(table.long(), (0, 0, 0, padding))
    cached = torch.nn.functional.pad(cached, (0, padding))
    new = torch.full_like(cached, tokens) if new is None else torch.nn.functional.pad(new, (0, padding), value=1)
    S, W = table.shape
    logical = torch.full((S, pool_blocks), W, dtype=torch.int32, device=table.device)
    logical.scatter_reduce_(1, table, torch.arange(W, dtype=torch.int32, device=table.device).expand(S, W), "amin")

    def visible(b, h, q, kv):
        return logical[b, kv // block_size] * block_size + kv % block_size <= cached[b] + q % tokens

    # The indices padded to the pool's width, as PagedAttention pads them (the CPU kernel reads that far).
    indices = torch.zeros(S, 1, 1, pool_blocks, dtype=torch.int32, device=table.device)
    indices[:, 0, 0, :W] = table
    counts = ((cached + new.clamp_min(1) + block_size - 1) // block_size).clamp_max(W).to(torch.int32)
    queries = group * tokens
    return BlockMask.from_kv_blocks(counts.view(S, 1, 1), indices, BLOCK_SIZE=(max(QUERY_BLOCK, bucket(queries)),
                                    block_size), mask_mod=visible, seq_lengths=(queries, pool_blocks * block_size),
                                    compute_q_blocks=False)


def attend_paged(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                 mask: BlockMask) -> tuple[torch.Tensor, torch.Tensor]:
    """T queries a sequence, q [S, Hq, T, D] (T as `paged_mask` took it), over pools [blocks, block_size, Hkv, D]
    read in place through `mask`. Returns out [S, Hq, T, D] and lse [S, Hq, T] (fp32, natural log)."""
    S = q.shape[0]
    keys, values = (pool.flatten(0, 1).transpose(0, 1)[None] for pool in (k_pool, v_pool))  # [1, Hkv, N, D] views
    queries = _folded(q, k_pool.shape[2])
    queries = torch.nn.functional.pad(queries, (0, 0, 0, 0, 0, 0, 0, mask.kv_num_blocks.shape[0] - S))  # its padding
    out, aux = _attend(queries, keys, values, mask, lse=True)
    return out[:S].reshape(q.shape), aux.lse[:S].reshape(q.shape[:3])


class PagedSteps:
    """Attention of `tokens` new tokens a row over a full cache's pools in place (`paged_mask`), for the forward's
    rows (table, cached, new as `paged_mask` takes them; device tensors, so that a static step's padded ones serve):
    a one-token step, or a forward of several tokens a row padded to a power of two (a compiled kernel serves few
    shapes). Built once a forward, its block mask made at the first layer (it needs the model's query heads a KV head)
    and read by every layer."""

    def __init__(self, table: torch.Tensor, cached: torch.Tensor, pool_blocks: int, block_size: int,
                 tokens: int = 1, new: torch.Tensor | None = None) -> None:
        self.tokens = bucket(tokens)
        self.rows = (table, cached, pool_blocks, block_size)
        self.new = torch.full_like(cached, tokens) if new is None and self.tokens > tokens else new
        self.masks: dict[int, BlockMask] = {}

    def attend(self, q: torch.Tensor, k_pool: torch.Tensor,
               v_pool: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`attend_paged` of the rows' queries q [S, Hq, T, D] (T at most `tokens`) over pools [blocks, block_size,
        Hkv, D]."""
        group = q.shape[1] // k_pool.shape[2]
        if group not in self.masks:
            self.masks[group] = paged_mask(*self.rows, group, self.tokens, self.new)
        T = q.shape[2]
        if T == self.tokens:
            return attend_paged(q, k_pool, v_pool, self.masks[group])
        out, lse = attend_paged(torch.nn.functional.pad(q, (0, 0, 0, self.tokens - T)), k_pool, v_pool,
                                self.masks[group])
        return out[:, :, :T], lse[:, :, :T]


def span_tiles(span: int, capacity: int) -> tuple[int, int] | None:
    """The keys `slots_mask` covers for a span of `span` entries in slots of `capacity` (the span rounded up to 16)
    and its key tile (the widest of 128, 64, 32 and 16 that divides them); None when they exceed the slots."""
    keys = -(-span // 16) * 16
    if keys > capacity:
        return None
    return keys, next(size for size in (128, 64, 32, 16) if keys % size == 0)


def slots_mask(held: torch.Tensor, span: int, block: int, group: int,
               holes: tuple[torch.Tensor, torch.Tensor] | None = None) -> BlockMask:
    """The block mask of `group` queries a slot (one token's, `_folded`) over the first `span` (a multiple of
    `block`) entries of each slot of a bounded cache's pools: slot b sees entries 0 .. held[b] (held [slots]: its
    entries before the step's token, which is the last); with `holes` (kept [slots, Hkv] and base [slots], an
    allocating evictor's, `bounded.hole_free`) not those of KV head h between kept[b, h] and base[b]."""
    slots, width = held.shape[0], span // block
    counts = (held // block + 1).to(torch.int32).view(slots, 1, 1)
    indices = torch.arange(width, dtype=torch.int32, device=held.device).repeat(slots, 1, 1, 1)
    if holes is None:
        def visible(b, h, q, kv):
            return kv <= held[b]
    else:
        kept, base = holes

        def visible(b, h, q, kv):
            return (kv <= held[b]) & ((kv < kept[b, h]) | (kv >= base[b]))
    return BlockMask.from_kv_blocks(counts, indices, BLOCK_SIZE=(QUERY_BLOCK, block), mask_mod=visible,
                                    seq_lengths=(group, span), compute_q_blocks=False)


def attend_slots(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: BlockMask) -> torch.Tensor:
    """One query a slot, q [slots, Hq, 1, D], over k, v [slots, Hkv, span, D] (views of the pools) through `mask`
    (`slots_mask`); [slots, Hq, 1, D]."""
    return _attend(_folded(q, k.shape[1]), k, v, mask).reshape(q.shape)


class SlotSteps:
    """A one-token step's attention over a bounded cache's pools in place: every pool slot a batch entry of its own
    (the step's queries scattered to their rows' slots), slot b seeing its entries 0 .. held (the step's token last);
    slots outside the step see their entry 0. Built once a step, read by every layer."""

    def __init__(self, pool_slots: int, slots: torch.Tensor, held: torch.Tensor, tiles: tuple[int, int],
                 group: int, base: torch.Tensor | None = None) -> None:
        """slots, held [R]: the rows' slots and entries before the step; `tiles` from `span_tiles`; `group` query
        heads a KV head; an allocating evictor's rows' `base` [R] (their holes then come per layer, `attend`'s
        `kept`)."""
        self.slots, self.tiles, self.group = slots, tiles, group
        self.held = held.new_zeros(pool_slots).index_copy_(0, slots, held)
        self.base = None if base is None else base.new_zeros(pool_slots).index_copy_(0, slots, base)
        self.mask = slots_mask(self.held, *tiles, group) if base is None else None

    def attend(self, q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
               kept: torch.Tensor | None = None) -> torch.Tensor:
        """The rows' queries q [R, Hq, 1, D] over their slots of pools [slots, Hkv, capacity, D], without the holes
        between kept [R, Hkv] (the rows' KV heads' entries kept at their last compression) and `base`."""
        mask = self.mask
        if mask is None:
            kept = kept.new_zeros(self.held.shape[0], kept.shape[1]).index_copy_(0, self.slots, kept)
            mask = slots_mask(self.held, *self.tiles, self.group, holes=(kept, self.base))
        keys = self.tiles[0]
        queries = q.new_zeros(k_pool.shape[0], *q.shape[1:]).index_copy_(0, self.slots, q)
        return attend_slots(queries, k_pool[:, :, :keys], v_pool[:, :, :keys], mask).index_select(0, self.slots)
