"""The one memory planner: the bytes a cell allocates on each device, from model configs and run settings alone.

`run` (its refusal, `--batch auto`, `--plan`) and `kvrescue cost` read it; no torch here. Counted per device
(one rank's shard under `--tp`), in the run's dtype, as the engine allocates it:
- weights: each distinct model once (the helper-loglik scorer reads the helper's);
- KV: every cache of the cell at the size it is built: the bounded base pool (rows x (B' + max step), its query
  rings, its capacity regrown for a longer prompt), the full caches in whole blocks, the helper-loglik scorer's
  cache besides the sampled helper's (two caches: summed);
- buffers: each sampling runner's fp32 next-token logits (rows rounded up to 64 x a power of two) and its step
  lanes (each candidate's draws table and detector state), the helper-loglik scorer's last logits per problem, and
  on CUDA with graphs their pool (one decode forward with its FlexAttention block mask or one iteration's sampling,
  whichever is larger, and every row bucket's logits; a full cache's commit forward; the PRM's: one scoring forward
  at its largest bucket of rows and tokens, and the buckets' outputs) and the step lanes' scratch lane;
- activations: the largest transient of any one moment: a forward's peak (a batch of prompts, a decode step and
  its sampling, with FlexAttention's block mask over a full cache on CUDA without flash-attn, a commit and the
  base's compression, the PRM's or helper-loglik's scoring of every candidate, padded to the longest), or a
  regrowth (old and new copies at once).
A device's peak is weights + KV + buffers + the largest transient; it fits when that is at most its free
memory less HEADROOM (allocator fragmentation, kernels' workspaces, the CUDA context's growth).
Not counted: a PRM refit (a problem whose context outgrew the PRM window is fed again whole), cascade
attention's extra pass over shared prefixes, and the bounded cache's FlexAttention block mask (a few ints a pool
slot). The bytes of each piece are `engine_bytes`'; a plan against a device's memory is `memory_fit`'s.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Callable, Iterable

from kvrescue.cell_plan import BOUNDED, NATIVE, CellPlan
from kvrescue.cost import Architecture, format_bytes
from kvrescue.detect import DetectorConfig
from kvrescue.engine_bytes import (FP32, FULL_BLOCK, Keys, blocks, compress_bytes, forward_bytes, full_cache_tokens,
                                   loglik_cache_tokens, paged_mask_bytes, sample_bytes, step_lanes_bytes)
from kvrescue.errors import InputError
from kvrescue.methods import METHODS
from kvrescue.model_config import ModelArgs, ModelConfigError
from kvrescue.prm_catalogue import REFEEDS
from kvrescue.scorers import HELPER_LOGLIK, PRM
from kvrescue.shapes import (FLASH_BLOCK, GROUP_CASCADE_FROM, OBSERVATION_WINDOW, PRM_WINDOW, BUFFER, cascade_cost_on,
                             bucket, local_args, rows_at_once, rows_room, shard_degree, token_kv_bytes)

PROMPT_TOKENS = 512  # the longest prompt planned for (MATH-500's chat prompts stay below 400 tokens)


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
    prm_refeeds: bool = False  # the PRM feeds each committed step with the next candidates (`REFEEDS`; `auto`: may)
    accumulates: bool = False  # the evictor keeps each entry's received attention (H2O: fp32 per entry and KV head)
    step_draws: int | None = None  # columns of a step's draws table: max_step_tokens, or a synthetic step's length
    detector_window: int = DetectorConfig.ent_window  # the detector's entropy ring a candidate keeps (1: no detector)


@dataclass(frozen=True)
class DeviceKind:
    """How the engine computes on a device: which kernels, hence which temporaries."""

    cuda: bool = False
    dtype_bytes: int = 4
    flash: bool = False  # flash-attn serves the full caches (and the static decode step)
    cuda_graphs: bool = False  # the one-token decode steps (evicted base, full caches) are captured
    tp: int = 1
    invariant: bool = False  # --deterministic: each group of candidates cascades by its own prefix

    @property
    def flex(self) -> bool:
        """FlexAttention serves the one-token steps (engine/flex.py) and the full caches' forwards over cached keys: on
        CUDA without flash-attn, unless --deterministic."""
        return self.cuda and not self.flash and not self.invariant


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


def cascade_shared(groups: int, group: int, invariant: bool, cuda: bool, token_bytes: int, tokens: int) -> int:
    """The fewest shared tokens from which a forward of `groups` groups of `group` candidates each, `tokens` new ones
    a row, reads their shared prefixes through cascade attention (engine/paged_forward.py's `cascading`): where the
    device's cost model (`cascade_cost_on(cuda)`) says the re-read it saves (of `token_bytes` a layer) pays for its
    extra pass, or with `invariant` (--deterministic) where each group alone re-reads GROUP_CASCADE_FROM."""
    if invariant:
        return -(-GROUP_CASCADE_FROM // (group - 1))
    need = cascade_cost_on(cuda).fewest_re_read_bytes(groups * group * tokens)
    return int(need // (token_bytes * groups * (group - 1))) + 1  # re-read more than `need`


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
        start = cascade_shared(s.batch, group, dev.invariant, dev.cuda, token_kv_bytes(r.args.n_kv_heads,
                               r.args.head_dim, b), tokens) if group > 1 else None
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
        buffer = rows_room(s.batch * (s.n + 1))
        add(role, "buffers", buffer * r.vocab * FP32, f"fp32 logits of {buffer} rows")
        add(role, "buffers", step_lanes_bytes(rows_open + graphs, s.step_draws or step, s.detector_window),
            f"step lanes of {rows_open} candidates: draws and detector state"
            + (", and the graphs' scratch lane" if graphs else ""))
        moment(role, buffer // 2 * r.vocab * FP32, "logits buffer doubling (old + new)")
        moment(role, fwd(r, s.batch, prompt, prefill), f"prefill of {s.batch} prompts")
        moment(role, max(sample_bytes(rows_open, r.vocab), decode() + rows_open * r.vocab * FP32),
               f"decode step of {rows_open} candidates and its sampling")
        moment(role, fwd(r, s.batch, step, commit), f"commit of {s.batch} steps")

    graphs = dev.cuda and dev.cuda_graphs

    def static_forward(r: _Role, rows: int, tokens: int, keys: int, table: int, out: int,
                       head: str = "last") -> tuple[int, int]:
        """`graphs._FullSide`'s forward of `rows` rows x `tokens` new tokens, bucketed, over `keys` keys of a full
        cache whose rows hold at most `table` tokens (the whole table with flash-attn, and past it; else the blocks'
        bucket): its bytes at the rows one forward takes (`rows_at_once`), and those of each (rows, tokens)
        bucket's `out` head outputs a row."""
        tokens, group = bucket(tokens), r.args.n_heads // r.args.n_kv_heads
        width = blocks(table, block) + blocks(tokens - 1, block) if dev.flash else bucket(keys // block) * block
        rows = bucket(rows) if dev.flash else rows_at_once(bucket(rows), group * tokens * width * b)
        outputs = 2 * rows * out * b * tokens.bit_length()
        return fwd(r, rows, tokens, Keys("flash" if dev.flash else "masked", width), head), outputs

    def graph_pool(role: str, r: _Role, keys: Keys, mask: int = 0) -> None:
        """The CUDA graphs' memory pool of a runner's one-token steps and its sampling (`steps.StepDecoder`, the same
        pool: one or the other runs at a time): a decode step at the largest row bucket (with its block mask's `mask`
        bytes) or that bucket's sampling, and each row bucket's logits."""
        rows = bucket(rows_open)
        add(role, "buffers", max(fwd(r, rows, 1, keys) + mask, sample_bytes(rows, r.vocab)) + 2 * rows * r.vocab * b,
            "CUDA graph pool: a decode step or its sampling, each row bucket's logits")

    def full_runner(role: str) -> None:
        r = roles[role]
        add(role, "kv", (blocks(full_tokens, block) + graphs * block) * r.kv_token,
            f"full K/V: {full_tokens} tokens" + (" and the graphs' scratch block" if graphs else ""))
        pool_blocks = blocks(full_tokens, block) // block + graphs
        mask = paged_mask_bytes(rows_open, pool_blocks) if dev.flex else 0  # bucketed: graphs' rows and eager's alike
        if graphs:
            graph_pool(role, r, Keys("flash" if dev.flash else "masked", blocks(cap, block)), mask)
        # The commits in static shapes (`Runner.commit`): in the decode steps' pool, counted as if it held both at once
        if graphs and not dev.invariant:
            add(role, "buffers", sum(static_forward(r, s.batch, step, blocks(cap, block), cap + step, r.vocab)),
                f"CUDA graph pool: a commit of {s.batch} steps, each bucket's logits")
        sampling_runner(role, r, Keys(path, blocks(prompt, block)),
                        lambda: forked(r, rows_open, 1, path, blocks(cap, block), block) + mask,
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
        static = graphs and not dev.invariant  # its forwards in static shapes (`PRMScorer`)
        add("prm", "kv", (blocks(tokens, block) + static * block) * r.kv_token,
            f"PRM K/V: {tokens} tokens" + (" and the graphs' scratch block" if static else ""))
        suffix = s.prm_step_tokens or step + 1
        keys = blocks(min(PRM_WINDOW + suffix, cap + cap // step + 1), block)  # the context and a tag per step
        head = "score" if r.arch.score_head else "last"  # an LM-head PRM's (RLHFlow's, Math-Shepherd's): its logits
        scored = candidates + (s.batch if s.prm_refeeds and not dev.invariant else 0)  # and steps fed with them
        if static:
            add("prm", "buffers", sum(static_forward(r, candidates, suffix, keys, PRM_WINDOW + block,
                                                     2 if r.arch.score_head else r.vocab, head)),
                "CUDA graph pool: the PRM's scoring forward at its largest bucket, each bucket's outputs")
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
        synthetic, detector = plan.settings.synthetic_steps, plan.settings.detector
        base = plan.base.cache if plan.base is not None and plan.base.engine == NATIVE else None
        shapes.append(CellShape(batch or plan.batch, plan.n, base, plan.budget if base == BOUNDED else None,
                                plan.helper is not None and plan.helper.engine == NATIVE,
                                plan.scorer.kind if plan.scorer.engine == NATIVE else None, plan.max_step_tokens,
                                plan.context_cap, buffer=BUFFER if plan.buffer is None else plan.buffer,
                                accumulates=plan.accumulates,
                                step_draws=min(plan.max_step_tokens, synthetic[0]) if synthetic else None,
                                detector_window=detector.ent_window if METHODS[plan.method].detector else 1,
                                prm_refeeds=plan.scorer.kind == PRM and plan.scorer.prm_recipe in REFEEDS + ("auto",)))
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


def readable_plan(plans: list[CellPlan], models: dict[str, str], dev: DeviceKind,
                  batch: int | None = None) -> DevicePlan | None:
    """`plan_grid` of the models by role, or None when one has no readable config (the loader then says why)."""
    try:
        return plan_grid(plans, grid_models(models), dev, batch)
    except ModelConfigError:
        return None


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
