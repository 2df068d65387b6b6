"""Temperature / top-k / top-p sampling with one counter-based random stream per candidate.

A candidate's stream key is derived once on the host from (run seed, problem idx, step, candidate
index); its t-th token uses the uniform hash(key, t), computed for every row at once on the logits'
device. A row's draw depends only on its own logits, key and counter, so a run is reproducible and a
candidate's draws do not depend on which rows share its batch (its logits may, in their last bits:
README, "Reproducibility"). Every sampled token also comes with
the exact full-vocabulary entropy (nats) of softmax(logits) at T = 1.

Stream version 2 (recorded in every run folder's config): a murmur3-finaliser hash in exact 32-bit
integer arithmetic on int64 tensors, 24-bit uniforms. Version 1 was a per-row Python splitmix64; runs
made with it drew different tokens.
"""

from collections.abc import Sequence

import numpy as np
import torch

import kvrescue.engine.invariance as invariance
from kvrescue.sampling_params import SamplingParams

STREAM_VERSION = 2
_MASK64 = (1 << 64) - 1
_MASK32 = 0xFFFFFFFF
_GOLDEN32 = 0x9E3779B9


def _mix64(z: int) -> int:
    """splitmix64 finaliser: a bijective 64-bit hash."""
    z = (z + 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def stream_key(*parts: int) -> int:
    """A 63-bit stream key from integers, e.g. (seed, problem idx, step, candidate index); computed once per candidate."""
    z = 0
    for p in parts:
        z = _mix64(z ^ (p & _MASK64))
    return z >> 1


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2^32 for 0 <= x < 2^32, without leaving int64: with c = hi * 2^16 + lo, x * hi * 2^16 only
    keeps the low 16 bits of x mod 2^32, so both products stay below 2^48."""
    return (x * (c & 0xFFFF) + (x & 0xFFFF) * (c & 0xFFFF0000)) & _MASK32


def _fmix32(h: torch.Tensor) -> torch.Tensor:
    """murmur3's 32-bit finaliser (a bijection of [0, 2^32))."""
    h = h ^ (h >> 16)
    h = _mul32(h, 0x85EBCA6B)
    h = h ^ (h >> 13)
    h = _mul32(h, 0xC2B2AE35)
    return h ^ (h >> 16)


def counter_stages(limit: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """The first stage of `uniforms`, which depends on the counter alone, for every counter below `limit`: a
    decoder whose counters stay below it tables it once (`uniforms(..., stages=)`)."""
    return _fmix32((torch.arange(limit, device=device) & _MASK32) ^ _GOLDEN32)


def uniforms(keys: torch.Tensor | np.ndarray, counters: torch.Tensor | np.ndarray,
             stages: torch.Tensor | np.ndarray | None = None) -> torch.Tensor | np.ndarray:
    """The counters[i]-th uniform in [0, 1) of stream keys[i], for all rows at once (int64 [R] each, float32 [R]):
    torch tensors, or numpy arrays on the host (the same values; a step decoder draws a step's there, `steps`).
    `stages`: `counter_stages(limit)` (as an array, on the host) when every counter is below limit (the same values,
    fewer operations)."""
    h = _fmix32((counters & _MASK32) ^ _GOLDEN32) if stages is None else stages[counters]
    h = _fmix32(h ^ (keys & _MASK32))
    h = _fmix32(h ^ (keys >> 32)) >> 8
    return (h.astype(np.float32) if isinstance(h, np.ndarray) else h.to(torch.float32)) * 2.0**-24


def entropy(logits: torch.Tensor) -> torch.Tensor:
    """Full-vocabulary entropy (nats) of softmax(logits) over the last dimension, in fp32: with z = logits - max,
    H = log S - sum(e^z z) / S where S = sum(e^z), one exp per logit and no log of each probability (a -inf
    logit, clamped to the lowest float, adds 0). Its sums are `invariance.row_sum`s."""
    z = logits.float() - logits.amax(-1, keepdim=True).float()
    z.clamp_(min=torch.finfo(torch.float32).min)
    e = z.exp()
    total = invariance.row_sum(e)
    return total.log() - invariance.row_sum(e * z) / total


def as_keys(keys: Sequence[Sequence[int] | int], device: torch.device | str = "cpu") -> torch.Tensor:
    """Stream keys as an int64 tensor: tuples such as (seed, problem, step, candidate) are hashed with `stream_key`."""
    return torch.tensor([k if isinstance(k, int) else stream_key(*k) for k in keys], dtype=torch.long, device=device)


def sample(
    logits: torch.Tensor,
    keys: torch.Tensor | Sequence[Sequence[int] | int],
    counters: torch.Tensor | Sequence[int],
    params: SamplingParams = SamplingParams(),
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row of logits [R, V]: returns (tokens LongTensor [R], entropies FloatTensor [R]).

    keys[i] is row i's stream (an int64 tensor of `stream_key`s, or tuples / ints that become one);
    counters[i] is the index of the token being drawn (tokens the row sampled so far). Everything
    stays on the logits' device: no host synchronisation.
    """
    if params.temperature == 0:
        return sample_drawn(logits, None, params)
    if not isinstance(keys, torch.Tensor):
        keys = as_keys(keys, logits.device)
    if not isinstance(counters, torch.Tensor):
        counters = torch.tensor(list(counters), dtype=torch.long, device=logits.device)
    return sample_drawn(logits, uniforms(keys, counters), params)


def sample_drawn(logits: torch.Tensor, draws: torch.Tensor | None,
                 params: SamplingParams = SamplingParams()) -> tuple[torch.Tensor, torch.Tensor]:
    """`sample` with each row's uniform drawn already: draws [R] float32, `uniforms` of its stream key and counter
    (a decoder tables a step's draws when it starts: `steps.StepDecoder`); None when greedy."""
    logits = logits.float()
    ent = entropy(logits)
    if params.temperature == 0:
        return logits.argmax(-1), ent
    k = logits.shape[-1] if params.top_k <= 0 else min(params.top_k, logits.shape[-1])
    vals, idx = torch.topk(logits, k, dim=-1, sorted=True)
    vals = vals / params.temperature  # after the top k: the same values as dividing every logit first
    probs = torch.softmax(vals, dim=-1)
    if params.top_p < 1.0:
        mass_before = probs.cumsum(-1) - probs
        probs = probs * (mass_before < params.top_p)  # the top token always survives (mass before it is 0)
    cdf = probs.cumsum(-1)
    pick = torch.searchsorted(cdf, (draws * cdf[:, -1])[:, None], right=True).clamp_(max=k - 1)
    # A pick past the kept tokens can only come from float rounding at the very top of the cdf.
    pick = torch.minimum(pick, (probs > 0).sum(-1, keepdim=True) - 1).clamp_(min=0)  # 0: a NaN row (steps.py ends it)
    return idx.gather(-1, pick)[:, 0], ent
