"""What the engine's pieces allocate, from shapes alone (no torch): one forward's temporaries (`Keys` says which
kernel reads which keys), a compression's, sampling's, FlexAttention's block mask over a full cache, a runner's step
lanes (the draws table and the detector's state), the caches' token room and a runner's logits rows. `memory_plan`
sums them per cell and device."""

from __future__ import annotations

from dataclasses import dataclass

from kvrescue.model_config import ModelArgs
from kvrescue.shapes import (CHUNK_TOKENS, LOGITS_BYTES, OBSERVATION_WINDOW, QUERY_GROUP, SCORE_BYTES,
                             SIMILARITY_ROWS, bucket, compress_slice, rows_room)

FULL_BLOCK = 16  # the full cache's block size off flash-attn (engine/caches.py)
FP32 = 4


@dataclass(frozen=True)
class Keys:
    """The keys each row of a forward attends to, and through which kernel."""

    path: str  # masked (the bounded cache: SDPA over the gathered rows), rows (the full cache's CPU path: whole rows
    # padded to the longest), chunks (its torch path on a GPU: in chunks, or whole rows where the mask fits) or flash
    keys: int  # cached + new keys of the longest row
    groups: int = 0  # the rows are candidates forked from this many committed rows, read through cascade attention
    shared: int = 0  # tokens of each group's shared prefix


def attention_bytes(a: ModelArgs, b: int, rows: int, tokens: int, k: Keys, cuda: bool) -> tuple[int, int]:
    """(bytes held for the whole forward, bytes one layer's attention adds at its peak) for `rows` x `tokens` new
    queries over `k`; `cuda`: SDPA there turns a boolean mask into a bias in the queries' dtype."""
    hq, hkv, hd, g = a.n_heads, a.n_kv_heads, a.head_dim, a.n_heads // a.n_kv_heads
    repeated = tokens > 1  # the mask repeated per grouped query is a copy, unless one row of it serves every query
    out = rows * hq * tokens * hd * b
    if k.path == "masked":
        return rows * tokens * k.keys, (2 * rows * hkv * k.keys * hd * b  # K, V gathered from the rows' slots
                                        + repeated * rows * g * tokens * k.keys * (1 + b * cuda)
                                        + rows * hq * (2 * OBSERVATION_WINDOW + tokens) * hd * b)  # the query ring
    if k.path == "flash":
        return 0, out
    cascade = k.groups > 0
    own = k.keys - k.shared + FULL_BLOCK if cascade else k.keys  # a row's keys past the shared blocks
    # Whole rows: the mask and its bias, held for the forward (on CUDA laid out for the grouped queries; on a CPU each
    # layer repeats it per grouped query while it attends); K, V gathered; out (on CUDA copied back from its kernel's
    # layout); the CPU kernel's lse.
    grouped = (g if repeated else 1) * rows * tokens * own * b
    whole = ((rows * tokens * own + grouped, 2 * rows * hkv * own * hd * b + 2 * out) if cuda else
             (rows * tokens * own * (1 + b), 2 * rows * hkv * own * hd * b + repeated * grouped + out
              + rows * hq * tokens * FP32))
    chunks = rows * -(-own // CHUNK_TOKENS)
    scores = min(SCORE_BYTES, FP32 * chunks * hq * tokens * CHUNK_TOKENS)
    # K, V gathered and made contiguous; the fp32 scores, their exponentials; the fp32 outputs
    chunked = (0, 4 * chunks * CHUNK_TOKENS * hkv * hd * b + scores * 5 // 2 + 2 * rows * hq * tokens * hd * FP32)
    if k.path == "rows":
        held, kernel = whole
    elif cascade or rows * QUERY_GROUP * tokens * own * b > SCORE_BYTES:
        held, kernel = chunked
    else:  # whole rows or chunks, whichever reads fewer blocks (`attention.paged_layout`): the larger
        held, kernel = max(whole, chunked, key=sum)
    if cascade:  # the shared pass, then the merge of its results with the rows' own
        shared = 2 * k.groups * hkv * k.shared * hd * b + 2 * out
        kernel = max(kernel, 2 * out + shared + 3 * rows * hq * tokens * hd * FP32)
    return held, kernel


def forward_bytes(a: ModelArgs, b: int, rows: int, tokens: int, keys: Keys, head: str, vocab: int,
                  cuda: bool = False) -> int:
    """Peak bytes of the temporaries of one forward of `rows` x `tokens` new tokens, for one rank's shapes `a` in
    `b`-byte elements. `head`: last (logits at each row's last token), all (at every token), chunked (every token's
    log-likelihood, LOGITS_BYTES of fp32 logits at a time from the hidden states) or score (the PRM's)."""
    t = rows * tokens
    d, hq, hkv, hd, inter = a.dim, a.n_heads, a.n_kv_heads, a.head_dim, a.intermediate_size
    qkv, qk = t * (hq + 2 * hkv) * hd * b, t * (hq + hkv) * hd * b
    x, norm = t * d * b, 8 * t * d  # the residual stream; an RMSNorm's fp32 temporaries
    held, kernel = attention_bytes(a, b, rows, tokens, keys, cuda)
    held += 2 * t * hd * b  # RoPE cos, sin
    out = t * hq * hd * b
    attend = qkv + max(3 * qk, qk + kernel + 2 * out)
    mlp = 2 * x + t * 4 * inter * b
    layer = x + max(norm, x + attend, x + norm, mlp)
    fp32 = FP32 if b < FP32 else 0  # the fp32 copy of half-precision logits
    chunk = min(t, max(1, LOGITS_BYTES // (FP32 * vocab)))  # positions per chunk of `scoring.chosen_logprobs`
    logits = {"last": rows * vocab * (b + fp32), "all": t * vocab * (b + fp32), "score": 2 * rows * d * b,
              "chunked": t * d * b + chunk * vocab * (b + 2 * FP32) + t * FP32}[head]
    return held + max(layer, x + norm, x + rows * d * b + logits)


def compress_bytes(a: ModelArgs, b: int, rows: int, length: int) -> int:
    """Peak temporaries of compressing `rows` bounded rows of `length` entries (R-KV's similarity of up to
    SIMILARITY_ROWS keys against all, per layer and KV head, fp32), in the slices `BoundedCache.compress` takes."""
    cut = compress_slice(a.n_layers, a.n_kv_heads, length)
    units = min(rows, cut.rows) * cut.layers * cut.kv_heads
    return units * (9 * min(length, SIMILARITY_ROWS) * length + length * a.head_dim * (b + 2 * FP32))


def sample_bytes(rows: int, vocab: int) -> int:
    """Sampling's fp32 temporaries over `rows` rows of logits: the rows' copy, and the entropy's three."""
    return 4 * rows * vocab * FP32


def paged_mask_bytes(rows: int, pool_blocks: int) -> int:
    """FlexAttention's block mask of a one-token step (or a forward of several tokens: one query tile a row) of `rows`
    rows over a full cache of `pool_blocks` blocks (`flex.paged_mask`), as long as the step reads it: its rows padded
    to a power of two, each with its block count (int32), its indices padded to the pool's width and its map from pool
    block to key index (int32 each), and its cached lengths (int64)."""
    return bucket(rows) * (2 * 4 * pool_blocks + 4 + 8)


def step_lanes_bytes(rows: int, columns: int, window: int) -> int:
    """The step lanes of a runner decoding up to `rows` candidates at once (`steps.StepDecoder`: a power of two, at
    `shapes.rows_room`): per lane the step's draws (fp32, one a column), the detector's entropy ring (fp64,
    `window`), its largest mean (fp64), token and character counts (int64) and the last token's end flag."""
    return rows_room(rows) * (FP32 * columns + 8 * window + 8 + 8 + 8 + 1)


def blocks(tokens: int, size: int) -> int:
    return -(-tokens // size) * size


def full_cache_tokens(batch: int, n: int, max_step_tokens: int, context_cap: int) -> int:
    """Token room of a full-context cache (base `full`, sampled helper): each problem's context and 2N steps."""
    return batch * (context_cap + 2 * n * max_step_tokens)


def loglik_cache_tokens(batch: int, n: int, max_step_tokens: int, context_cap: int) -> int:
    """Token room of the helper-loglik scorer's cache."""
    return batch * (2 * context_cap + 2 * n * max_step_tokens)
