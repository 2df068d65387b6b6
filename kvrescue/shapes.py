"""Shape arithmetic shared by the engine, the memory planner and `kvrescue cost`, free of torch so that `kvrescue
cost` starts without it: the engine's sizing constants (the bounded cache's buffer, windows, blocks, memory bounds),
and what one rank of a tensor-parallel group holds (engine/tp.py)."""

from __future__ import annotations

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
# With batch invariance on (any device), a group of rows cascades when it alone would re-read GROUP_CASCADE_FROM
# shared tokens (engine/paged_forward.py says why); otherwise the device's CascadeCost decides.
GROUP_CASCADE_FROM = 3584
SCORE_BYTES = 1 << 28  # bound on the fp32 scores of one torch paged call; longer query sets are sliced
# Query heads a KV head, at most, in the bound on a whole rows' mask off a CPU (engine/attention.paged_layout; Qwen2.5's
# models have 6 or 7, Qwen3's and Llama 3's 8): the mask is laid out for each of a KV head's query heads.
QUERY_GROUP = 8
LOGITS_BYTES = 1 << 28  # bound on the fp32 logits helper-loglik's log-likelihoods hold at once


ROWS_ROOM = 64  # a runner's per-row buffers (kept logits, step lanes) hold at least this many rows


def bucket(rows: int) -> int:
    """A row bucket of the static steps and their compiled kernels: the next power of two."""
    return 1 << max(rows - 1, 0).bit_length()


def rows_at_once(rows: int, row_mask_bytes: int, score_bytes: int = SCORE_BYTES) -> int:
    """Rows of one static forward of several tokens a row (engine/graphs.py) whose SDPA mask takes `row_mask_bytes`
    a row: all, or where they would pass `score_bytes`, the largest power of two within it (at least 1)."""
    fitting = max(1, score_bytes // max(row_mask_bytes, 1))
    return rows if fitting >= rows else 1 << (fitting.bit_length() - 1)


def rows_room(rows: int) -> int:
    """The rows a runner's per-row buffer (engine/runner.py's kept logits, engine/steps.py's step lanes) grows to
    for `rows` of them: a power of two, at least ROWS_ROOM; what the memory planner counts."""
    return max(bucket(rows), ROWS_ROOM)


@dataclass(frozen=True)
class CascadeCost:
    """The time of one layer's attention read in a full cache's forward, paged (every row reads all its blocks) or
    cascaded (a group's shared blocks read once for all its rows, then each row's own blocks): the K/V bytes each
    reads over an effective bandwidth, and for cascade its extra pass: a fixed cost (launches) and one per query token
    (its grouped queries' layout, the merge of the two softmax states). Every layer pays alike, so one layer decides
    for the forward; the cost both paths pay alike (the rows' own blocks, the new keys) cancels out."""

    bytes_per_s: float  # K/V bytes the paged read goes through per second
    pass_s: float  # the extra pass's fixed seconds per layer
    query_s: float  # its seconds per query token (grouped rows x new tokens) per layer

    def extra_s(self, queries: int) -> float:
        """Seconds one layer's cascade spends beyond its reads, for `queries` grouped query tokens."""
        return self.pass_s + self.query_s * queries

    def pays(self, re_read_bytes: float, queries: int) -> bool:
        """Whether cascade is faster: the time of the shared bytes it does not re-read exceeds its extra pass's."""
        return re_read_bytes / self.bytes_per_s > self.extra_s(queries)

    def fewest_re_read_bytes(self, queries: int) -> float:
        """The shared bytes a layer's rows must otherwise re-read for cascade to pay (`pays`: more than this)."""
        return self.extra_s(queries) * self.bytes_per_s


# Each device kind's constants, measured (docs/benchmarks.md, "Cascade's cost model"): the CPU's fitted by
# benchmarks/speed/cascade_fit.py over the helper's shape; CUDA's from the one H200 pair (paged 13.0 ms, cascade 30.4
# ms a step at 8 problems x N = 8 over about 1.5k shared tokens, no flash-attn), its whole extra pass put per query
# token (the choice that cascades least at gpu_check's attention shapes) until gpu_check's attention section, which
# prints this model's times next to the measured ones, recalibrates it.
CASCADE_COSTS = {"cpu": CascadeCost(bytes_per_s=5.0e8, pass_s=2.7e-3, query_s=0.0),
                 "cuda": CascadeCost(bytes_per_s=2.2e11, pass_s=0.0, query_s=15.8e-6)}
ALWAYS_CASCADE = CascadeCost(bytes_per_s=1.0, pass_s=0.0, query_s=0.0)  # cascade whenever rows share a block


def cascade_cost_on(cuda: bool) -> CascadeCost:
    """The cost model the full cache chooses cascade by outside --deterministic, on CUDA or a CPU."""
    return CASCADE_COSTS["cuda" if cuda else "cpu"]


def token_kv_bytes(kv_heads: int, head_dim: int, dtype_bytes: int) -> int:
    """Bytes of one cached token's K and V in one layer."""
    return 2 * kv_heads * head_dim * dtype_bytes


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
