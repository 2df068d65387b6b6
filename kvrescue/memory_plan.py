"""The one memory planner: the bytes a cell allocates on each device, from model configs and run settings alone.

`run` (its refusal, `--batch auto`, `--plan`) and `kvrescue cost` read it; no torch here. Counted per device
(one rank's shard under `--tp`), in the run's dtype, as the engine allocates it:
- weights: each distinct model once (the helper-loglik scorer reads the helper's);
- KV: every cache of the cell at the size it is built: the bounded base pool (rows x (B' + max step), its query
  rings, its capacity regrown for a longer prompt), the full caches in whole blocks, the helper-loglik scorer's
  cache besides the sampled helper's (two caches: summed);
- buffers: each sampling runner's fp32 next-token logits (rows rounded up to 64 x a power of two), the
  helper-loglik scorer's last logits per problem, and on CUDA with graphs their pool (one decode forward and
  every row bucket's logits);
- activations: the largest transient of any one moment: a forward's peak (a batch of prompts, a decode step
  and its sampling, a commit and the base's compression, the PRM's or helper-loglik's scoring of every
  candidate, padded to the longest), or a regrowth (old and new copies at once).
A device's peak is weights + KV + buffers + the largest transient; it fits when that is at most its free
memory less HEADROOM (allocator fragmentation, kernels' workspaces, the CUDA context's growth).
Not counted: a PRM refit (a problem whose context outgrew the PRM window is fed again whole) and cascade
attention's extra pass over shared prefixes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Iterable

from kvrescue.cell_plan import BOUNDED, NATIVE, CellPlan
from kvrescue.cost import Architecture, format_bytes
from kvrescue.errors import InputError
from kvrescue.model_config import ModelArgs, ModelConfigError
from kvrescue.scorers import HELPER_LOGLIK, PRM
from kvrescue.shapes import (CHUNK_TOKENS, FLASH_BLOCK, GROUP_CASCADE_FROM, LOGITS_BYTES, OBSERVATION_WINDOW,
                                 PRM_WINDOW, QUERY_GROUP, SCORE_BYTES, SIMILARITY_ROWS, BUFFER, cascade_from_on,
                                 compress_slice, bucket, local_args, shard_degree)

GIB = 2**30
PROMPT_TOKENS = 512  # the longest prompt planned for (MATH-500's chat prompts stay below 400 tokens)
HEADROOM_SHARE, HEADROOM_MIN = 0.05, GIB  # of a device's free memory kept free: 5%, at least 1 GiB
MAX_BATCH = 4096  # the largest batch `--batch auto` considers
LOGITS_ROWS = 64  # a runner's logits buffer starts with 64 rows and doubles (engine/runner.py)
FULL_BLOCK = 16  # the full cache's block size off flash-attn (engine/caches.py)
FP32 = 4


@dataclass(frozen=True)
class CellShape:
    """What one cell runs on this engine, as far as memory goes."""

    batch: int
    n: int
    base: str | None  # "bounded" (evicting), "full", or None (no base here)
    budget: int | None
    helper: bool  # helper candidates sampled here
    scorer: str | None  # "prm", "helper-loglik", or None (the PRM on vLLM)
    max_step_tokens: int = 512
    context_cap: int = 4096
    prompt_tokens: int = PROMPT_TOKENS
    buffer: int = BUFFER  # W: the bounded cache peaks at B' = B + W entries
    prm_step_tokens: int | None = None  # the PRM's tokens for one step: by default the policy's + its step tag
    accumulates: bool = False  # the evictor keeps each entry's received attention (H2O: fp32 per entry and KV head)


@dataclass(frozen=True)
class DeviceKind:
    """How the engine computes on a device: which kernels, hence which temporaries."""

    cuda: bool = False
    dtype_bytes: int = 4
    flash: bool = False  # flash-attn serves the full caches (and the static decode step)
    cuda_graphs: bool = False  # the one-token decode steps (evicted base, full caches) are captured
    tp: int = 1
    invariant: bool = False  # --deterministic: each group of candidates cascades by its own prefix


@dataclass(frozen=True)
class Part:
    """Bytes of one thing on a device."""

    role: str
    kind: str  # weights, kv, buffers, activations
    bytes: int
    what: str


@dataclass
class DevicePlan:
    """One device's memory for the largest cell: what stays allocated, and each moment's transient."""

    parts: list[Part] = field(default_factory=list)  # allocated for the whole cell (weights: for the run)
    moments: list[Part] = field(default_factory=list)  # kind "activations": one of them at a time
    batch: int = 0
    cell: CellShape | None = None
    ranks: dict[str, int] = field(default_factory=dict)  # role -> devices one copy of its model spans

    @property
    def peak_moment(self) -> Part:
        return max(self.moments, key=lambda m: m.bytes, default=Part("-", "activations", 0, "none"))

    @property
    def total(self) -> int:
        return sum(p.bytes for p in self.parts) + self.peak_moment.bytes

    def bytes(self, role: str | None = None, kind: str | None = None) -> int:
        """Allocated bytes of a role and/or kind (activations: the role's largest moment)."""
        if kind == "activations":
            return max((m.bytes for m in self.moments if role in (None, m.role)), default=0)
        return sum(p.bytes for p in self.parts if role in (None, p.role) and kind in (None, p.kind))

    @property
    def roles(self) -> list[str]:
        return list(dict.fromkeys(p.role for p in self.parts + self.moments))


def headroom(free: int) -> int:
    """Bytes of a device's free memory a plan leaves unused."""
    return max(HEADROOM_MIN, int(HEADROOM_SHARE * free))


# -- what one forward allocates at its peak ----------------------------------------------------------
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


def cascade_shared(groups: int, group: int, invariant: bool, cuda: bool = False) -> int | None:
    """The fewest shared tokens from which a forward of `groups` groups of `group` candidates each reads their shared
    prefixes through cascade attention (engine/paged_forward.py's `cascading`; None: never): re-read
    `cascade_from_on(cuda)` times over the forward, or with `invariant` (--deterministic) GROUP_CASCADE_FROM times by
    each group alone."""
    whole = cascade_from_on(cuda)
    if not invariant and math.isinf(whole):
        return None
    re_read = GROUP_CASCADE_FROM if invariant else -(-whole // groups)
    return -(-re_read // (group - 1))


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


def logits_rows(rows: int) -> int:
    """Rows of a runner's logits buffer holding row ids below `rows`: 64 doubled until it does."""
    size = LOGITS_ROWS
    while size < rows:
        size *= 2
    return size


def blocks(tokens: int, size: int) -> int:
    return -(-tokens // size) * size


def full_cache_tokens(batch: int, n: int, max_step_tokens: int, context_cap: int) -> int:
    """Token room of a full-context cache (base `full`, sampled helper): each problem's context and 2N steps."""
    return batch * (context_cap + 2 * n * max_step_tokens)


def loglik_cache_tokens(batch: int, n: int, max_step_tokens: int, context_cap: int) -> int:
    """Token room of the helper-loglik scorer's cache."""
    return batch * (2 * context_cap + 2 * n * max_step_tokens)


# -- one cell --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class _Role:
    name: str
    arch: Architecture
    ranks: int  # d: devices one copy spans
    args: ModelArgs  # one rank's shapes
    kv_token: int  # one token's K + V bytes on one rank

    @property
    def vocab(self) -> int:
        return self.arch.args.vocab_size


def _role(arch: Architecture, tp: int, base: bool, b: int) -> _Role:
    a = arch.args
    try:
        d = shard_degree(a.n_heads, a.n_kv_heads, a.intermediate_size, tp, exact_heads=base)
    except ValueError as e:
        raise InputError(f"{arch.name}: {e}") from None
    sized = replace(arch, dtype_bytes=b)
    return _Role(arch.name, sized, d, local_args(a, d), sized.rank_kv_bytes_per_token(d))


def plan_cell(models: dict[str, Architecture], cell: CellShape, dev: DeviceKind) -> DevicePlan:
    """One device's plan for one cell; `models`: role (base, helper, prm) -> architecture."""
    b, s = dev.dtype_bytes, cell
    roles = {role: _role(arch, dev.tp, role == "base", b) for role, arch in models.items()}
    plan = DevicePlan(batch=s.batch, cell=s, ranks={role: r.ranks for role, r in roles.items()})

    def add(role: str, kind: str, n: int, what: str) -> None:
        plan.parts.append(Part(role, kind, int(n), what))

    def moment(role: str, n: int, what: str) -> None:
        plan.moments.append(Part(role, "activations", int(n), what))

    def fwd(r: _Role, rows: int, tokens: int, keys: Keys, head: str = "last") -> int:
        return forward_bytes(r.args, b, rows, tokens, keys, head, r.vocab, dev.cuda)

    def forked(r: _Role, rows: int, tokens: int, path: str, keys: int, block: int, head: str = "last") -> int:
        """A forward of candidates forked from `s.batch` committed rows, at its longest context (cascading over
        their shared prefix from `cascade_shared` tokens) or the longest that does not cascade."""
        group = rows // s.batch
        start = cascade_shared(s.batch, group, dev.invariant, dev.cuda) if group > 1 else None
        if start is None:
            return fwd(r, rows, tokens, Keys(path, keys), head)
        longest = fwd(r, rows, tokens, Keys(path, keys, s.batch, keys - tokens) if keys - tokens >= start
                      else Keys(path, keys), head)
        below = (start - 1) // block * block  # shared tokens that do not cascade
        return max(longest, fwd(r, rows, tokens, Keys(path, min(keys, blocks(below + tokens, block))), head))

    loaded: set[str] = set()
    for role in sorted(roles):
        r = roles[role]
        if r.name not in loaded:
            loaded.add(r.name)
            add(role, "weights", r.arch.rank_params(r.ranks) * b, f"{r.name}, {r.ranks} rank(s) per copy")
    block = FLASH_BLOCK if dev.flash else FULL_BLOCK
    path = "flash" if dev.flash else ("chunks" if dev.cuda else "rows")
    step, prompt, cap = s.max_step_tokens, min(s.prompt_tokens, s.context_cap - 1), s.context_cap
    rows_open = s.batch * s.n  # candidates one runner decodes at once
    full_tokens = full_cache_tokens(s.batch, s.n, step, cap)

    def sampling_runner(role: str, r: _Role, prefill: Keys, decode: Callable[[], int], commit: Keys) -> None:
        """A runner that prefills prompts, decodes candidates and commits steps (base or helper)."""
        buffer = logits_rows(s.batch * (s.n + 1))
        add(role, "buffers", buffer * r.vocab * FP32, f"fp32 logits of {buffer} rows")
        moment(role, buffer // 2 * r.vocab * FP32, "logits buffer doubling (old + new)")
        moment(role, fwd(r, s.batch, prompt, prefill), f"prefill of {s.batch} prompts")
        moment(role, max(sample_bytes(rows_open, r.vocab), decode() + rows_open * r.vocab * FP32),
               f"decode step of {rows_open} candidates and its sampling")
        moment(role, fwd(r, s.batch, step, commit), f"commit of {s.batch} steps")

    graphs = dev.cuda and dev.cuda_graphs

    def graph_pool(role: str, r: _Role, keys: Keys) -> None:
        """The CUDA graphs' memory pool of a runner's one-token steps: a decode step at the largest row bucket, and
        each row bucket's logits."""
        rows = bucket(rows_open)
        add(role, "buffers", fwd(r, rows, 1, keys) + 2 * rows * r.vocab * b,
            "CUDA graph pool: a decode step, each row bucket's logits")

    def full_runner(role: str) -> None:
        r = roles[role]
        add(role, "kv", (blocks(full_tokens, block) + graphs * block) * r.kv_token,
            f"full K/V: {full_tokens} tokens" + (" and the graphs' scratch block" if graphs else ""))
        if graphs:
            graph_pool(role, r, Keys("flash" if dev.flash else "masked", blocks(cap, block)))
        sampling_runner(role, r, Keys(path, blocks(prompt, block)),
                        lambda: forked(r, rows_open, 1, path, blocks(cap, block), block),
                        Keys(path, blocks(cap, block)))  # a step ends where the context reaches the cap

    if s.base == "bounded":
        r, peak = roles["base"], s.budget + s.buffer
        rows = s.batch * (s.n + 1) + graphs  # + the graphs' scratch slot
        capacity = peak + step if prompt <= peak + step else -(-prompt // 64) * 64  # `BoundedCache.begin`'s growth
        per_slot = r.args.n_layers * r.args.n_kv_heads * r.args.head_dim * b
        ring = r.args.n_layers * rows * r.args.n_heads * OBSERVATION_WINDOW * r.args.head_dim * b
        add("base", "kv", 2 * rows * capacity * per_slot, f"bounded K/V: {rows} rows x {capacity} entries")
        add("base", "kv", ring, f"query rings of {rows} rows")
        if s.accumulates:
            add("base", "kv", rows * capacity * r.args.n_layers * r.args.n_kv_heads * FP32,
                f"received attention (H2O): {rows} rows x {capacity} entries")
        if capacity > peak + step:
            moment("base", rows * (peak + step) * per_slot + ring, "pool regrowth for the longest prompt")
        if graphs:
            moment("base", rows * capacity * per_slot + ring, "pool regrowth for the graphs' scratch slot")
            graph_pool("base", r, Keys("flash" if dev.flash else "masked", peak))
        sampling_runner("base", r, Keys("masked", prompt), lambda: fwd(r, rows_open, 1, Keys("masked", peak)),
                        Keys("masked", peak - 1 + step))
        dim = r.args.dim * b  # the forward's last hidden states stay alive while the rows are compressed
        moment("base", max(compress_bytes(r.args, b, rows_open, peak) + rows_open * dim,
                           compress_bytes(r.args, b, s.batch, peak + step - 1) + s.batch * step * dim),
               "compression of the rows that reached B'")
    elif s.base == "full":
        full_runner("base")
    if s.helper:
        full_runner("helper")
    candidates = s.batch * s.n * ((s.base is not None) + s.helper)
    if s.scorer == PRM:
        r = roles["prm"]
        tokens = s.batch * (PRM_WINDOW + block) + s.batch * 2 * s.n * (step + block + 1)  # `PRMScorer.cache_tokens`
        add("prm", "kv", blocks(tokens, block) * r.kv_token, f"PRM K/V: {tokens} tokens")
        suffix = s.prm_step_tokens or step + 1
        keys = blocks(min(PRM_WINDOW + suffix, cap + cap // step + 1), block)  # the context and a tag per step
        head = "score" if r.arch.score_head else "last"  # an LM-head PRM's (RLHFlow's, Math-Shepherd's): its logits
        scored = candidates + (0 if dev.invariant else s.batch)  # and the committed steps fed with them (`PRMScorer`)
        moment("prm", forked(r, scored, suffix, path, keys, block, head), f"scoring of {candidates} candidates")
        fed = max(prompt, suffix)  # a problem's prompt, or its last committed step
        moment("prm", fwd(r, s.batch, fed, Keys(path, keys), head),
               f"feed of {s.batch} problems' prompts or steps")
    elif s.scorer == HELPER_LOGLIK:
        r = roles["helper"]
        tokens = loglik_cache_tokens(s.batch, s.n, step, cap)
        add(HELPER_LOGLIK, "kv", blocks(tokens, block) * r.kv_token, f"scorer K/V: {tokens} tokens")
        add(HELPER_LOGLIK, "buffers", s.batch * r.vocab * FP32, "fp32 last logits of each problem")
        moment(HELPER_LOGLIK, forked(r, candidates, step, path, blocks(cap + step, block), block, "chunked"),
               f"log-likelihoods of {candidates} candidates")
    return plan


# -- a grid ----------------------------------------------------------------------------------------
def cell_shapes(plans: Iterable[CellPlan], batch: int | None = None) -> list[CellShape]:
    """Every distinct cell of a grid's `CellPlan`s (`GridOptions.cell_plans`) as the planner sees it (`batch`: in place
    of theirs)."""
    shapes = []
    for plan in plans:
        base = plan.base.cache if plan.base is not None and plan.base.engine == NATIVE else None
        shapes.append(CellShape(batch or plan.batch, plan.n, base, plan.budget if base == BOUNDED else None,
                                plan.helper is not None and plan.helper.engine == NATIVE,
                                plan.scorer.kind if plan.scorer.engine == NATIVE else None, plan.max_step_tokens,
                                plan.context_cap, buffer=BUFFER if plan.buffer is None else plan.buffer,
                                accumulates=plan.accumulates))
    return list(dict.fromkeys(shapes))


def grid_models(models: dict[str, str]) -> dict[str, Architecture]:
    """The architectures of the models by role the grid runs on this engine (`GridOptions.native_models`), from their
    config.json files (no weights)."""
    return {role: Architecture.of_model(name) for role, name in sorted(models.items())}


def plan_grid(plans: list[CellPlan], models: dict[str, Architecture], dev: DeviceKind,
              batch: int | None = None) -> DevicePlan:
    """One device's plan for the largest of a grid's cells (`batch`: problems in flight instead of the grid's), on
    its `grid_models`."""
    return max((plan_cell(models, cell, dev) for cell in cell_shapes(plans, batch)), key=lambda p: p.total)


def largest_batch(plan: Callable[[int], DevicePlan], room: int) -> int | None:
    """The largest batch (up to MAX_BATCH) whose plan fits in `room` bytes, or None when one problem does not."""
    if plan(1).total > room:
        return None
    low, high = 1, MAX_BATCH
    while low < high:
        mid = (low + high + 1) // 2
        low, high = (mid, high) if plan(mid).total <= room else (low, mid - 1)
    return low


def readable_plan(plans: list[CellPlan], models: dict[str, str], dev: DeviceKind,
                  batch: int | None = None) -> DevicePlan | None:
    """`plan_grid` of the models by role, or None when one has no readable config (the loader then says why)."""
    try:
        return plan_grid(plans, grid_models(models), dev, batch)
    except ModelConfigError:
        return None


def gib(n: int) -> str:
    return f"{n / GIB:.1f} GiB"


def summary(plan: DevicePlan) -> str:
    """One line: each role's weights + KV + buffers + activation peak."""
    parts = [f"{role} {gib(plan.bytes(role, 'weights'))} + KV {gib(plan.bytes(role, 'kv'))} + buffers "
             f"{gib(plan.bytes(role, 'buffers'))}" for role in plan.roles]
    peak = plan.peak_moment
    return ", ".join(parts) + f", activations {gib(peak.bytes)} at the {peak.role} {peak.what}"


def plan_rows(plan: DevicePlan, tp: int) -> list[tuple[str, str]]:
    """(quantity, value) rows of one device's plan, for `kvrescue cost`'s table."""
    rows = []
    for role in plan.roles:
        spans = plan.ranks.get(role, plan.ranks.get("helper", 1))
        rows.append((f"per device, --tp {tp}: {role} ({spans} rank{'s' if spans > 1 else ''} per copy) weights / KV / "
                     "buffers / activation peak", " / ".join(format_bytes(plan.bytes(role, kind)) for kind in
                                                             ("weights", "kv", "buffers", "activations"))))
    peak = plan.peak_moment
    return rows + [(f"per device, --tp {tp}: total (peak: the {peak.role} {peak.what})", format_bytes(plan.total))]


def plan_json(plan: DevicePlan, tp: int) -> dict[str, Any]:
    """One device's plan for `kvrescue cost --format json`: each role's bytes by kind, and the total."""
    return {"tp": tp, "batch": plan.batch, "device_bytes": plan.total,
            "peak": {"role": plan.peak_moment.role, "what": plan.peak_moment.what},
            "devices": [{"role": role, "ranks": plan.ranks.get(role, plan.ranks.get("helper", 1)),
                         **{f"{kind}_bytes": plan.bytes(role, kind) for kind in ("weights", "kv", "buffers")},
                         "activation_bytes": plan.bytes(role, "activations")} for role in plan.roles]}


def refuse_what_does_not_fit(plan: DevicePlan | None, free: int, device: str, beside_vllm: bool = False,
                             hints: Iterable[str] = ()) -> None:
    """A one-line error when `plan` needs more than `free` bytes less the headroom."""
    if plan is None:
        return
    room = free - headroom(free)
    if plan.total > room:
        left = "left beside vLLM's share" if beside_vllm else "free"
        raise InputError(f"batch {plan.batch} needs {gib(plan.total)} on {device} ({summary(plan)}) but "
                         f"{gib(free)} is {left} ({gib(room)} after {gib(headroom(free))} of headroom); "
                         f"{'lower --batch (or --batch auto) or ' if plan.batch > 1 else 'lower '}"
                         f"--n{''.join(', ' + h for h in hints)}, "
                         "or use larger devices")
