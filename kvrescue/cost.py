"""Decode memory and compute of KV-Rescue from model configs (the paper's Appendix D).

Conventions (they reproduce the paper's Table 4):
- KV bytes per token = 2 (K and V) x layers x KV heads x head dim x bytes per element.
- Dense decode FLOPs per token = 2 x total parameters, embedding matrix and untied LM head included
  (Qwen2.5-Math-7B: 2 x 7.62e9 = 15.2 GFLOP; Qwen2.5-72B: 2 x 72.7e9 = 145.4 GFLOP).
- Attention decode FLOPs per token at context L = 4 x layers x query heads x head dim x L
  (q.k and the weighted sum of values, 2 FLOPs per multiply-add).
- The evicted base cache peaks at B' = B + w entries per sequence (w = 128, DESIGN.md section 3).
- Crossover context L* = (1 + alpha) x B': the context beyond which evicted decoding, including its
  overhead (alpha x the attention cost over B' entries; the paper measures alpha = 2.9), is cheaper
  than full-KV attention.
- rho (Eq. 15) = helper decode FLOPs / base decode FLOPs per token at context L: the helper's dense FLOPs and
  attention over L, against the base's dense FLOPs and (1 + alpha) x its attention over min(L, B') (the evicted
  base pays the eviction's overhead on top of its attention). Qwen2.5-Math 7B and 1.5B at B = 64: 24.4%.
- Per device under tensor parallelism over K devices (`--tp K`, engine/tp.py): each model is split over
  d ranks (d = K for the base), so one rank holds 1/d of its heads and MLP columns, its KV heads (or one
  replicated KV head), ceil(vocab / d) embedding and LM-head rows, and whole norms (and PRM score head)
  (`Architecture.rank_params`); what each device allocates for a run is `memory_plan.py`'s.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from kvrescue.dtypes import BYTES
from kvrescue.jsonl import dumps_exact
from kvrescue.model_config import ModelArgs, ModelConfigError, load_config
from kvrescue.shapes import BUFFER, local_args

@dataclass
class Architecture:
    """The decoder shape numbers cost depends on: a model's `ModelArgs` and its weights' bytes per element."""

    name: str
    args: ModelArgs
    dtype_bytes: int
    score_head: bool = False  # a process reward model: Linear(H, H), Linear(H, 2) in place of the LM head

    @classmethod
    def from_config(cls, name: str, cfg: dict[str, Any]) -> Architecture:
        """Read a Hugging Face config.json dict (Qwen2 / Llama style)."""
        try:
            args = ModelArgs.from_hf(cfg)
            prm = any("ProcessRewardModel" in a for a in cfg.get("architectures") or [])
        except (KeyError, TypeError, ValueError) as e:
            raise ModelConfigError(f"{name}: config.json lacks or mangles {e} (need a Qwen2/Llama decoder config)") from None
        return cls(name, args, BYTES.get(str(cfg.get("torch_dtype", "bfloat16")), 2), prm)

    @classmethod
    def of_model(cls, model: str) -> Architecture:
        """The architecture of a model folder, config.json or Hub id (`load_config`); ModelConfigError if unusable."""
        return cls.from_config(model, load_config(model))

    @property
    def kv_bytes_per_token(self) -> int:
        return self.rank_kv_bytes_per_token(1)

    @property
    def params(self) -> int:
        """Total parameters: embeddings, decoder layers, final norm, LM head (unless tied) or PRM head."""
        return self.rank_params(1)

    def rank_kv_bytes_per_token(self, d: int) -> int:
        """K + V bytes of one token on one of d ranks (its KV heads, at least one)."""
        a = local_args(self.args, d)
        return 2 * a.n_layers * a.n_kv_heads * a.head_dim * self.dtype_bytes

    def rank_params(self, d: int) -> int:
        """Parameters one of d ranks holds (d = 1: the whole model)."""
        a = local_args(self.args, d)
        q, kv = a.n_heads * a.head_dim, a.n_kv_heads * a.head_dim
        attn = a.dim * (q + 2 * kv) + q * a.dim + (q + 2 * kv if a.qkv_bias else 0)
        layer = attn + 3 * a.dim * a.intermediate_size + 2 * a.dim
        embed = -(-a.vocab_size // d) * a.dim
        if self.score_head:
            head = a.dim * a.dim + a.dim + 2 * a.dim + 2
        else:
            head = 0 if a.tie_word_embeddings else embed
        return a.n_layers * layer + a.dim + embed + head

    @property
    def dense_flops(self) -> int:
        return 2 * self.params

    def attention_flops(self, context: int) -> int:
        a = self.args
        return 4 * a.n_layers * a.n_heads * a.head_dim * context


@dataclass
class Cost:
    """Appendix D numbers for one base/helper pair at one budget, context and N."""

    base: str
    helper: str
    budget: int
    physical_budget: int
    context: int
    n: int
    alpha: float
    base_kv_bytes_per_token: int
    helper_kv_bytes_per_token: int
    base_full_kv_bytes: int           # one sequence, full cache over `context` tokens
    base_evicted_kv_bytes: int        # one sequence, evicted cache at its B' peak
    base_full_kv_bytes_n: int         # N candidates
    base_evicted_kv_bytes_n: int
    helper_kv_bytes_n: int            # N helper candidates, full context
    kvrescue_kv_bytes_n: int          # evicted base + full helper, N candidates each
    base_params: int
    helper_params: int
    base_dense_flops: int
    helper_dense_flops: int
    base_full_attention_flops: int    # at `context`
    base_evicted_attention_flops: int # at min(context, B')
    helper_attention_flops: int       # at `context`
    crossover_context: float
    rho: float
    rho_dense: float


def estimate(base: Architecture, helper: Architecture, budget: int = 64, context: int = 4096,
             n: int = 8, alpha: float = 2.9, buffer: int = BUFFER) -> Cost:
    """Memory and FLOPs per decoded token for the evicted base, the full base and the helper."""
    bp = budget + buffer
    kept = min(context, bp)
    base_decode = base.dense_flops + (1 + alpha) * base.attention_flops(kept)
    helper_decode = helper.dense_flops + helper.attention_flops(context)
    return Cost(
        base=base.name, helper=helper.name, budget=budget, physical_budget=bp, context=context, n=n,
        alpha=alpha,
        base_kv_bytes_per_token=base.kv_bytes_per_token,
        helper_kv_bytes_per_token=helper.kv_bytes_per_token,
        base_full_kv_bytes=base.kv_bytes_per_token * context,
        base_evicted_kv_bytes=base.kv_bytes_per_token * kept,
        base_full_kv_bytes_n=n * base.kv_bytes_per_token * context,
        base_evicted_kv_bytes_n=n * base.kv_bytes_per_token * kept,
        helper_kv_bytes_n=n * helper.kv_bytes_per_token * context,
        kvrescue_kv_bytes_n=n * (base.kv_bytes_per_token * kept + helper.kv_bytes_per_token * context),
        base_params=base.params, helper_params=helper.params,
        base_dense_flops=base.dense_flops, helper_dense_flops=helper.dense_flops,
        base_full_attention_flops=base.attention_flops(context),
        base_evicted_attention_flops=base.attention_flops(kept),
        helper_attention_flops=helper.attention_flops(context),
        crossover_context=(1 + alpha) * bp,
        rho=helper_decode / base_decode,
        rho_dense=helper.dense_flops / base.dense_flops,
    )


def cost_rows(c: Cost) -> list[tuple[str, str]]:
    """(quantity, value) rows for display."""
    return [
        ("KV per token: base / helper", f"{_kib(c.base_kv_bytes_per_token)} / {_kib(c.helper_kv_bytes_per_token)}"),
        (f"base KV per sequence: full (L={c.context}) / evicted (B'={c.physical_budget})",
         f"{format_bytes(c.base_full_kv_bytes)} / {format_bytes(c.base_evicted_kv_bytes)}"),
        (f"base KV for N={c.n}: full / evicted", f"{format_bytes(c.base_full_kv_bytes_n)} / {format_bytes(c.base_evicted_kv_bytes_n)}"),
        (f"helper KV for N={c.n} (full)", format_bytes(c.helper_kv_bytes_n)),
        (f"KV-Rescue KV for N={c.n}: evicted base + helper", format_bytes(c.kvrescue_kv_bytes_n)),
        ("parameters: base / helper", f"{_si(c.base_params)} / {_si(c.helper_params)}"),
        ("dense decode FLOPs/token: base / helper",
         f"{_si(c.base_dense_flops, 'FLOP')} / {_si(c.helper_dense_flops, 'FLOP')}"),
        ("attention FLOPs/token: base full / base evicted / helper",
         f"{_si(c.base_full_attention_flops, 'FLOP')} / {_si(c.base_evicted_attention_flops, 'FLOP')} / "
         f"{_si(c.helper_attention_flops, 'FLOP')}"),
        (f"crossover context (1 + {c.alpha:g}) x B'", f"{c.crossover_context:.0f} tokens"),
        ("helper compute fraction rho (dense only)", f"{c.rho:.3f} ({c.rho_dense:.3f})"),
    ]


def cost_json(c: Cost, devices: dict[str, Any]) -> bytes:
    """The estimate and the per-device plan (`memory_plan.plan_json`) as JSON (counts past 64 bits stay exact)."""
    return dumps_exact({**asdict(c), **devices}, indent=True)


def _si(x: float, unit: str = "") -> str:
    """15231233024 -> '15.2 G' + unit (three significant digits)."""
    for prefix, size in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if x >= size:
            return f"{x / size:.3g} {prefix}{unit}"
    return f"{x:.3g} {unit}".rstrip()


def _kib(b: int) -> str:
    return f"{b / 1024:g} KiB"


def format_bytes(b: int) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20)):
        if b >= size:
            return f"{b / size:.2f} {unit}"
    return _kib(b)
