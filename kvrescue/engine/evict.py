"""KV eviction policies (DESIGN section 3), kvpress style: each a frozen dataclass of its parameters with a `score`.

Every policy is a score over the *past* positions (all but the last ``OBSERVATION_WINDOW``); the shared
machinery keeps the top ``budget - OBSERVATION_WINDOW`` past positions plus the last ``OBSERVATION_WINDOW``, sorted by
position. All scores accept extra leading batch dimensions (rows), so the bounded cache scores
every row due for compression in one call:

    keys     [..., H_kv, L, D]     post-RoPE keys
    queries  [..., H_q, OBSERVATION_WINDOW, D] post-RoPE queries of the last OBSERVATION_WINDOW positions, H_q = g * H_kv
    received [..., H_kv, L]        (H2O) the attention each entry received since it entered, fp32, kept by the cache
    result   [..., H_kv, budget]   kept positions, ascending

Query heads ``h*g .. h*g+g-1`` share KV head ``h`` (the Hugging Face ``repeat_kv`` layout).
Equal scores are broken toward the earlier position.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields, replace
from fractions import Fraction
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor

from kvrescue.shapes import OBSERVATION_WINDOW, SCORE_BYTES, SIMILARITY_ROWS  # OBSERVATION_WINDOW: the last 8 positions, always kept
MIN_BUDGET = 2 * OBSERVATION_WINDOW  # the smallest budget B any evictor accepts


def past_attention(keys: Tensor, queries: Tensor) -> Tensor:
    """Each query's attention over the past keys, fp32, [..., H_kv, W, L - OBSERVATION_WINDOW]: logits q.k/sqrt(d), max over
    each KV head's query group (before softmax), softmax over the past keys."""
    h_kv, d = keys.shape[-3], keys.shape[-1]
    h_q, w = queries.shape[-3], queries.shape[-2]
    q = queries.float().reshape(*queries.shape[:-3], h_kv, h_q // h_kv, w, d)
    logits = q @ keys.float()[..., :-OBSERVATION_WINDOW, :].unsqueeze(-3).transpose(-1, -2) / math.sqrt(d)
    return logits.amax(dim=-3).softmax(dim=-1)


def importance(keys: Tensor, queries: Tensor, *, kernel: int = 7) -> Tensor:
    """SnapKV/R-KV attention importance of each past position, fp32, [..., H_kv, L - OBSERVATION_WINDOW]: the window
    queries' `past_attention` averaged, then 1-D max-pooled (kernel, stride 1, same padding)."""
    attn = past_attention(keys, queries).mean(dim=-2)  # [..., H_kv, L - OBSERVATION_WINDOW]
    flat = attn.reshape(-1, attn.shape[-1])
    return F.max_pool1d(flat, kernel, stride=1, padding=kernel // 2).reshape(attn.shape)


def redundancy(keys: Tensor, *, threshold: float = 0.5) -> Tensor:
    """R-KV redundancy of every cached position, fp32, [..., H_kv, L] (softmax over all L).

    S = cosine similarity of the keys with a zero diagonal. In each row i the entry of the most
    recent j with S[i, j] > threshold is zeroed, so key i counts against every near-duplicate but
    its newest one, which is thereby spared. When no j qualifies, j* = 0 as in the reference code:
    S[i, 0] is zeroed instead, so position 0 (usually BOS, the attention sink) collects no
    similarity from keys without near-duplicates and looks slightly less redundant.
    r_j = mean over rows i of S[i, j], then softmax over j (over all L positions, as in the
    reference; the caller drops the window positions afterwards). S is computed SIMILARITY_ROWS rows at a
    time (their column sums added in order), so a long row's scoring holds SIMILARITY_ROWS x L, not L x L.
    """
    k = keys.float()
    k = k / (k.norm(dim=-1, keepdim=True) + 1e-8)
    length = k.shape[-2]
    pos = torch.arange(length, device=k.device, dtype=torch.int32)
    total = None
    for start in range(0, length, SIMILARITY_ROWS):
        sim = k[..., start : start + SIMILARITY_ROWS, :] @ k.transpose(-1, -2)  # rows i of S, all columns j
        sim.diagonal(offset=start, dim1=-2, dim2=-1).zero_()
        last_similar = torch.where(sim > threshold, pos, 0).amax(dim=-1, keepdim=True)
        sim.scatter_(-1, last_similar.long(), 0.0)
        total = sim.sum(dim=-2) if total is None else total.add_(sim.sum(dim=-2))
    return (total / length).softmax(dim=-1)


def received_attention(q: Tensor, keys: Tensor, visible: Tensor, real: Tensor | None = None) -> Tensor:
    """H2O's observation: the attention each key receives from new queries, fp32 [R, H_kv, L]. Logits q.k/sqrt(d)
    of q [R, H_q, T, D] against keys [R, H_kv, L, D], max over each KV head's query group (before softmax, as
    `past_attention`), softmax over the keys each query sees (`visible` [R, T or 1, L]), summed over the queries
    where `real` [R, T] (all when None; padding queries are left out). Sliced over the queries so that one slice's
    logits stay within SCORE_BYTES (the softmax then holds 1/g of that)."""
    R, h_q, T, d = q.shape
    h_kv, length = keys.shape[1], keys.shape[2]
    g = h_q // h_kv
    k = keys.float().transpose(-1, -2)  # [R, H_kv, D, L]
    qg = q.float().view(R, h_kv, g, T, d)
    step = max(1, SCORE_BYTES // (4 * R * h_q * length))
    total = k.new_zeros(R, h_kv, length)
    for t in range(0, T, step):
        part = qg[:, :, :, t : t + step]  # the group's queries as rows of one matmul per KV head
        n = part.shape[3]
        logits = (part.reshape(R, h_kv, g * n, d) @ k).div_(math.sqrt(d)).view(R, h_kv, g, n, length).amax(dim=2)
        seen = visible[:, t : t + step] if visible.shape[1] > 1 else visible
        probs = logits.masked_fill_(~seen[:, None], -math.inf).softmax(dim=-1)
        if real is not None:
            probs.mul_(real[:, None, t : t + step, None])
        total += probs.sum(dim=2)
    return total


def top_order(scores: Tensor, k: int) -> Tensor:
    """The indices of the ``k`` highest scores along the last dimension, highest first (ties: earlier first)."""
    return torch.sort(scores, dim=-1, descending=True, stable=True).indices[..., :k]


def keep_top(scores: Tensor, budget: int) -> Tensor:
    """Top ``budget - OBSERVATION_WINDOW`` past positions by score (ties: earlier first) plus the last OBSERVATION_WINDOW, ascending."""
    past = scores.shape[-1]
    if not OBSERVATION_WINDOW < budget <= past + OBSERVATION_WINDOW:
        raise ValueError(f"budget {budget} must be in ({OBSERVATION_WINDOW}, {past + OBSERVATION_WINDOW}]")
    order = top_order(scores, budget - OBSERVATION_WINDOW)
    window = torch.arange(past, past + OBSERVATION_WINDOW, device=scores.device).expand(*scores.shape[:-1], OBSERVATION_WINDOW)
    return torch.cat([order, window], dim=-1).sort(dim=-1).values


@dataclass(frozen=True)
class Evictor:
    """One policy, kvpress style: a frozen dataclass whose fields are its parameters, and whose
    `score(keys, queries, received)` ranks the past positions [..., H_kv, L - OBSERVATION_WINDOW] (higher is kept);
    `keep_top` and the bounded cache around it are shared by all. `received` is the attention each cached entry
    received since it entered, [..., H_kv, L] (`received_attention`), kept by the cache only for a policy that
    `accumulates`; else None. A policy that `allocates` gives the layers (`layer_budgets`) or a layer's KV heads
    (`keep_past`) budgets of their own, the same total as a uniform B; the others keep B per layer and KV head."""

    name: ClassVar[str]
    description: ClassVar[str]
    accumulates: ClassVar[bool] = False
    allocates: ClassVar[bool] = False

    def score(self, keys: Tensor, queries: Tensor, received: Tensor | None = None) -> Tensor:
        raise NotImplementedError

    def layer_budgets(self, n_layers: int, budget: int, trigger: int) -> list[int]:
        """Each layer's budget: the entries per KV head a compression from B' = `trigger` keeps (B here)."""
        return [budget] * n_layers

    def keep_past(self, scores: Tensor, budget: int, most: int) -> Tensor:
        """Which past positions one layer keeps, bool like its scores [..., H_kv, past] (-inf where a head holds no
        entry): each KV head's top ``budget - OBSERVATION_WINDOW``. `most` bounds one head's entries (allocating
        policies)."""
        order = top_order(scores, budget - OBSERVATION_WINDOW)
        return torch.zeros_like(scores, dtype=torch.bool).scatter_(-1, order, True)

    def params(self) -> dict[str, Any]:
        """The parameters by name, as config.json records them."""
        return asdict(self)


@dataclass(frozen=True)
class RKV(Evictor):
    """R-KV score lam * importance - (1 - lam) * redundancy over the past positions."""

    name = "rkv"
    description = "R-KV (Cai et al. 2025): attention importance minus key redundancy"
    lam: float = 0.1
    kernel: int = 7
    threshold: float = 0.5

    def __post_init__(self) -> None:
        _odd_kernel(self.kernel)

    def score(self, keys: Tensor, queries: Tensor, received: Tensor | None = None) -> Tensor:
        red = redundancy(keys, threshold=self.threshold)[..., :-OBSERVATION_WINDOW]
        return self.lam * importance(keys, queries, kernel=self.kernel) - (1 - self.lam) * red


@dataclass(frozen=True)
class SnapKV(Evictor):
    """Decode-time SnapKV: R-KV without the redundancy term."""

    name = "snapkv"
    description = "SnapKV (Li et al. 2024) at decode time: attention importance alone"
    kernel: int = 7

    def __post_init__(self) -> None:
        _odd_kernel(self.kernel)

    def score(self, keys: Tensor, queries: Tensor, received: Tensor | None = None) -> Tensor:
        return importance(keys, queries, kernel=self.kernel)


@dataclass(frozen=True)
class Streaming(Evictor):
    """StreamingLLM as a score: the ``sinks`` first positions first, then by recency."""

    name = "streaming"
    description = "StreamingLLM (Xiao et al. 2023): the first positions (attention sinks) and the most recent"
    sinks: int = 4

    def __post_init__(self) -> None:
        if self.sinks < 0:
            raise ValueError(f"sinks={self.sinks}: need 0 or more")

    def score(self, keys: Tensor, queries: Tensor, received: Tensor | None = None) -> Tensor:
        past = keys.shape[-2] - OBSERVATION_WINDOW
        score = torch.arange(past, device=keys.device, dtype=torch.float32)
        score[: self.sinks] = math.inf
        return score.expand(*keys.shape[:-2], past)


@dataclass(frozen=True)
class TOVA(Evictor):
    """TOVA (Oren et al. 2024): the `past_attention` of the newest query alone (its query group combined as for R-KV)."""

    name = "tova"
    description = "TOVA (Oren et al. 2024): the newest query's attention alone"

    def score(self, keys: Tensor, queries: Tensor, received: Tensor | None = None) -> Tensor:
        return past_attention(keys, queries[..., -1:, :])[..., 0, :]


@dataclass(frozen=True)
class H2O(Evictor):
    """H2O (Zhang et al. 2023) at decode time: the attention each past entry received from every query since it
    entered (`received_attention`, accumulated by the cache), the heaviest kept."""

    name = "h2o"
    description = "H2O (Zhang et al. 2023): the attention each entry received from every query since it entered"
    accumulates = True

    def score(self, keys: Tensor, queries: Tensor, received: Tensor | None = None) -> Tensor:
        if received is None:
            raise ValueError("h2o scores the attention the cache accumulated: pass `received`")
        return received[..., :-OBSERVATION_WINDOW]


@dataclass(frozen=True)
class KNorm(Evictor):
    """Knorm (Devoto et al. 2024): the keys of smallest L2 norm kept, query-free."""

    name = "knorm"
    description = "Knorm (Devoto et al. 2024): the keys of smallest L2 norm, query-free"

    def score(self, keys: Tensor, queries: Tensor, received: Tensor | None = None) -> Tensor:
        return -keys[..., :-OBSERVATION_WINDOW, :].float().norm(dim=-1)


@dataclass(frozen=True)
class KeyDiff(Evictor):
    """KeyDiff (Park et al. 2025): the keys least similar to the anchor (the mean of the head's unit keys) kept,
    query-free; the anchor is taken over every cached key, as kvpress's `KeyDiffPress` does."""

    name = "keydiff"
    description = "KeyDiff (Park et al. 2025): the keys least similar to the mean key, query-free"

    def score(self, keys: Tensor, queries: Tensor, received: Tensor | None = None) -> Tensor:
        k = keys.float()
        anchor = F.normalize(k, dim=-1).mean(dim=-2, keepdim=True)
        return -F.cosine_similarity(k[..., :-OBSERVATION_WINDOW, :], anchor, dim=-1)


@dataclass(frozen=True)
class Random(Evictor):
    """A uniform random choice of the past positions, seeded: each position's score is a hash of `seed`, the row's
    keys (`key_fingerprint`: another row, layer, head or step draws anew) and the position, so a row draws the same
    whatever it is compressed with, on any device."""

    name = "random"
    description = "random: a seeded uniform choice of the past positions"
    seed: int = 0

    def __post_init__(self) -> None:
        if not 0 <= self.seed < 2**63:
            raise ValueError(f"seed={self.seed}: need 0 <= seed < 2**63")

    def score(self, keys: Tensor, queries: Tensor, received: Tensor | None = None) -> Tensor:
        past = keys.shape[-2] - OBSERVATION_WINDOW
        base = _mix(key_fingerprint(keys) ^ _mix(torch.tensor(self.seed, device=keys.device)))
        drawn = _mix(base.unsqueeze(-1) + torch.arange(past, device=keys.device))
        return _unit_interval(drawn)


@dataclass(frozen=True)
class PyramidKV(SnapKV):
    """PyramidKV (Cai et al. 2024) at decode time: SnapKV scores, the layers' budgets a pyramid shrinking with depth.
    kvpress's `PyramidKVPress.get_layer_budget` over the past positions of a compression from B', the window on top
    (as the authors' code adds it): past budgets with a mean of B - OBSERVATION_WINDOW run linearly from the first
    layer's most to the last's fewest, (B - OBSERVATION_WINDOW) / beta, the most capped so that no layer keeps more
    than B' - OBSERVATION_WINDOW entries. Exact fractions rounded half to even: the budgets sum to n_layers x B.
    Uniform where the last layer would keep under one past entry (kvpress asks fewest >= its window, which it counts
    inside the budget)."""

    name = "pyramidkv"
    description = "PyramidKV (Cai et al. 2024): SnapKV scores, per-layer budgets shrinking with depth"
    allocates = True
    beta: int = 20

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.beta < 1:
            raise ValueError(f"beta={self.beta}: need 1 or more")

    def layer_budgets(self, n_layers: int, budget: int, trigger: int) -> list[int]:
        mean = Fraction(budget - OBSERVATION_WINDOW)  # max_capacity_prompt - window_size
        fewest = mean / self.beta
        most = 2 * mean - fewest
        room = trigger - 2 * OBSERVATION_WINDOW  # q_len - window_size over the past positions
        if most >= room:
            most, fewest = Fraction(room), 2 * mean - room
        if n_layers == 1 or not most >= fewest >= 1:
            return [budget] * n_layers
        step = (most - fewest) / (n_layers - 1)
        return [round(most - layer * step) + OBSERVATION_WINDOW for layer in range(n_layers)]


@dataclass(frozen=True)
class AdaKV(Evictor):
    """Ada-KV (Feng et al. 2024) at decode time: a layer's KV heads share its budget by score mass, kvpress's
    `AdaKVPress.compress`: each head's top `safeguard` x (B - OBSERVATION_WINDOW) past positions first, then the
    layer's H_kv x (B - OBSERVATION_WINDOW) best of all its heads' past positions (ties: lower head, earlier
    position); no head keeps more than B' - OBSERVATION_WINDOW entries. Scored by R-KV or SnapKV (`scores`, their
    default settings)."""

    name = "adakv"
    description = "Ada-KV (Feng et al. 2024): per-head budgets within a layer by score mass, R-KV or SnapKV scores"
    allocates = True
    scores: str = "rkv"
    safeguard: float = 0.2

    def __post_init__(self) -> None:
        if self.scores not in ("rkv", "snapkv"):
            raise ValueError(f"scores={self.scores!r}: choose rkv or snapkv")
        if not 0 <= self.safeguard <= 1:
            raise ValueError(f"safeguard={self.safeguard}: need 0 <= safeguard <= 1")

    def score(self, keys: Tensor, queries: Tensor, received: Tensor | None = None) -> Tensor:
        return EVICTORS[self.scores].score(keys, queries, received)

    def keep_past(self, scores: Tensor, budget: int, most: int) -> Tensor:
        heads, past = scores.shape[-2:]
        share = budget - OBSERVATION_WINDOW
        ranked = top_order(scores, past)  # each head's positions, best first
        rank = torch.empty_like(ranked).scatter_(-1, ranked, torch.arange(past, device=scores.device).expand_as(ranked))
        boosted = scores.masked_fill(rank < int(share * self.safeguard), math.inf)
        boosted = boosted.masked_fill(rank >= most - OBSERVATION_WINDOW, -math.inf)
        chosen = top_order(boosted.flatten(-2), heads * share)
        keep = torch.zeros_like(boosted.flatten(-2), dtype=torch.bool).scatter_(-1, chosen, True)
        return keep.view(scores.shape)


_MASKS = {shift: (1 << (64 - shift)) - 1 for shift in (30, 27, 31)}  # a logical right shift of int64, as a mask


def _signed(x: int) -> int:
    return x - (1 << 64) if x >= 1 << 63 else x


_SPLITMIX = (_signed(0xBF58476D1CE4E5B9), _signed(0x94D049BB133111EB))


def _mix(x: Tensor) -> Tensor:
    """SplitMix64's finaliser on int64 tensors (products wrap modulo 2^64 on every device)."""
    x = x ^ ((x >> 30) & _MASKS[30])
    x = x * _SPLITMIX[0]
    x = x ^ ((x >> 27) & _MASKS[27])
    x = x * _SPLITMIX[1]
    return x ^ ((x >> 31) & _MASKS[31])


def key_fingerprint(keys: Tensor) -> Tensor:
    """A 64-bit hash of each head's cached keys [..., H_kv, L, D] -> int64 [..., H_kv]: every key's fp32 bits mixed
    with its index, summed modulo 2^64 (a sum of integers, the same in any order, so batch-invariant)."""
    bits = keys.float().contiguous().view(torch.int32).to(torch.int64)
    index = torch.arange(bits.shape[-2] * bits.shape[-1], device=keys.device).view(bits.shape[-2:])
    return _mix(bits + (index << 32)).sum(dim=(-2, -1))


def _unit_interval(x: Tensor) -> Tensor:
    """The top 53 bits of int64 hashes as float64 in [0, 1)."""
    return ((x >> 11) & ((1 << 53) - 1)).double() / 2**53


def _odd_kernel(kernel: int) -> None:
    if kernel < 1 or kernel % 2 == 0:
        raise ValueError(f"kernel={kernel}: the max-pool kernel must be odd and positive (same padding)")


EVICTORS: dict[str, Evictor] = {e.name: e for e in (RKV(), SnapKV(), Streaming(), TOVA(), H2O(), KNorm(), KeyDiff(),
                                                    Random(), PyramidKV(), AdaKV())}
NO_EVICTION = "none"  # `--evictor none`: the base keeps a full cache (no evictor runs)
CHOICES = (*EVICTORS, NO_EVICTION)


def evictor_named(evictor: Evictor | str) -> Evictor:
    """A policy given as itself or by name (its default settings)."""
    if isinstance(evictor, Evictor):
        return evictor
    if evictor not in EVICTORS:
        raise ValueError(f"policy {evictor!r} does not compress; choose one of {tuple(EVICTORS)}")
    return EVICTORS[evictor]


def parse_evictor(spec: str) -> tuple[str, dict[str, Any]]:
    """`NAME` or `NAME:FIELD=VALUE,...` (`--evictor rkv:lam=0.2,kernel=5`): the name, and the fields given with
    values of their fields' types, checked by building the policy (ValueError naming what is wrong). An unknown
    name without fields is left for the caller to refuse."""
    name, _, given = spec.partition(":")
    if not given:
        return name, {}
    if name not in EVICTORS:
        raise ValueError(f"unknown evictor {name!r} in --evictor {spec!r}; choose one of {', '.join(EVICTORS)}")
    kinds = {f.name: {"int": int, "float": float, "str": str}[str(f.type)] for f in fields(EVICTORS[name])}
    params: dict[str, Any] = {}
    for item in given.split(","):
        key, equals, value = item.partition("=")
        if key not in kinds or not equals:
            have = ", ".join(kinds) or "none"
            raise ValueError(f"--evictor {spec!r}: {item!r} is not FIELD=VALUE of one of {name}'s parameters ({have})")
        try:
            params[key] = kinds[key](value)
        except ValueError:
            raise ValueError(f"--evictor {spec!r}: {key} must be {kinds[key].__name__}, not {value!r}") from None
        if kinds[key] is not str and not (abs(params[key]) < 2**63 if kinds[key] is int
                                          else math.isfinite(params[key])):
            raise ValueError(f"--evictor {spec!r}: {key} must be finite and within 64 bits, not {value!r}")
    make_evictor(name, params)
    return name, params


def make_evictor(name: str, params: dict[str, Any]) -> Evictor:
    """The named policy with `params` in place of its defaults (ValueError for a value it refuses)."""
    try:
        return replace(evictor_named(name), **params)
    except ValueError as err:
        raise ValueError(f"--evictor {name}: {err}") from None


def keep_positions(evictor: Evictor | str, keys: Tensor, queries: Tensor, budget: int,
                   received: Tensor | None = None) -> Tensor:
    """Kept positions [..., H_kv, budget] under a policy (a name: its default settings)."""
    return keep_top(evictor_named(evictor).score(keys, queries, received), budget)


def gather_positions(x: Tensor, kept: Tensor) -> Tensor:
    """Select positions along dim -2: x [..., H, L, D], kept [..., H, B] -> [..., H, B, D]."""
    return x.gather(-2, kept.unsqueeze(-1).expand(*kept.shape, x.shape[-1]))
