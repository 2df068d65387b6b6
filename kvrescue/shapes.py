"""Shape arithmetic shared by the engine, the memory planner and `kvrescue cost`, free of torch so that `kvrescue
cost` starts without it: the engine's sizing constants (the bounded cache's buffer, windows, blocks, memory bounds),
and what one rank of a tensor-parallel group holds (engine/tp.py)."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from kvrescue.model_config import ModelArgs

MAX_STEP_TOKENS = 512  # the paper's caps: tokens of one step,
MAX_STEPS = 1024  # steps of one problem,
MAX_CONTEXT = 4096  # and tokens of its context (the prompt and the committed steps)
BUFFER = 128  # w: entries the bounded cache appends past the budget B before a compression (B' = B + w)
OBSERVATION_WINDOW = 8  # evictors' window alpha: the last 8 positions, always kept (their queries are kept too)
COMPRESS_BYTES = 1 << 30  # bound on the fp32 scoring memory of one compression call (`compress_slice`)
SIMILARITY_ROWS = 1024  # rows of R-KV's key-similarity matrix scored at once (a long row's L x L in slices)
PRM_WINDOW = 4096  # tokens of a problem's committed prefix the PRM sees (older steps are dropped)
FLASH_BLOCK = 256  # flash-attn's paged KV cache takes blocks of a multiple of 256 tokens
CHUNK_TOKENS = 128  # keys per unit of work of the torch paged path (whole blocks)
# On a CPU, cascade when a forward's rows would otherwise re-read at least this many shared tokens (engine/caches.py
# says why); with batch invariance on (any device), a group of rows cascades when it alone would re-read
# GROUP_CASCADE_FROM.
CASCADE_FROM = 1024
GROUP_CASCADE_FROM = 3584
SCORE_BYTES = 1 << 28  # bound on the fp32 scores of one torch paged call; longer query sets are sliced
# Query heads a KV head, at most, in the bound on a whole rows' mask off a CPU (engine/attention.paged_layout; Qwen2.5's
# models have 6 or 7, Qwen3's and Llama 3's 8): the mask is laid out for each of a KV head's query heads.
QUERY_GROUP = 8
LOGITS_BYTES = 1 << 28  # bound on the fp32 logits helper-loglik's log-likelihoods hold at once


def bucket(rows: int) -> int:
    """A row bucket of the static steps and their compiled kernels: the next power of two."""
    return 1 << max(rows - 1, 0).bit_length()


def cascade_from_on(cuda: bool) -> float:
    """The shared tokens a forward's rows must otherwise re-read for the full cache to cascade, outside
    --deterministic (inf: never). On a CPU, CASCADE_FROM; on CUDA never: cascade costs more than the reads it saves
    there (an H200 measured it slower than paged: docs/benchmarks.md)."""
    return math.inf if cuda else CASCADE_FROM


@dataclass(frozen=True)
class CompressSlice:
    """How much of a batch of bounded rows one compression call scores: rows, layers and KV heads."""

    rows: int
    layers: int
    kv_heads: int


def compress_slice(layers: int, kv_heads: int, length: int) -> CompressSlice:
    """The slice of rows of `length` entries one compression scores at once within COMPRESS_BYTES. Each (row, layer,
    KV head) holds fp32 similarities of up to SIMILARITY_ROWS keys against all `length` and their temporaries; rows
    are taken whole (all layers and KV heads) while one fits, a longer row some layers at a time, and a row so long
    that one layer does not fit (a 32k-token prompt on a 7B) some KV heads of one layer at a time."""
    units = max(1, COMPRESS_BYTES // (3 * 4 * min(length, SIMILARITY_ROWS) * length))
    if units >= layers * kv_heads:
        return CompressSlice(units // (layers * kv_heads), layers, kv_heads)
    if units >= kv_heads:
        return CompressSlice(1, units // kv_heads, kv_heads)
    return CompressSlice(1, 1, units)


def shard_degree(heads: int, kv_heads: int, width: int, k: int, *, exact_heads: bool = False) -> int:
    """The d ranks of a K-rank group that one copy of a model with these query heads, KV heads and MLP
    width spans (see engine/tp.py's docstring); with `exact_heads`, K itself or a ValueError."""
    if exact_heads:
        if heads % k or kv_heads % k or width % k:
            raise ValueError(
                f"--tp {k} must divide the base's {heads} query heads, {kv_heads} KV heads and MLP width "
                f"{width} (its evicting cache compresses each rank's own KV heads)"
            )
        return k
    return max(d for d in range(1, k + 1)
               if k % d == 0 and heads % d == 0 and width % d == 0 and (kv_heads % d == 0 or d % kv_heads == 0))


def local_args(args: ModelArgs, d: int) -> ModelArgs:
    """The shapes one rank computes when a model is sharded over d ranks (vocab and width stay whole)."""
    return replace(args, n_heads=args.n_heads // d, n_kv_heads=max(args.n_kv_heads // d, 1),
                   intermediate_size=args.intermediate_size // d)
