"""Temperature / top-k / top-p sampling with one counter-based random stream per candidate.

A candidate's stream key is derived from (run seed, problem idx, step, candidate index); its t-th token
uses the uniform hash(key, t). Each row's draw depends only on its own logits, key and counter, so a run
is reproducible and a candidate's tokens do not depend on which rows share its batch. Every sampled
token also comes with the exact full-vocabulary entropy (nats) of softmax(logits) at T = 1.
"""

from collections.abc import Sequence
from dataclasses import dataclass

import torch

_MASK = (1 << 64) - 1


@dataclass(frozen=True)
class SamplingParams:
    """Temperature 0 means greedy; top_k 0 and top_p 1.0 disable those filters."""

    temperature: float = 0.8
    top_p: float = 0.95
    top_k: int = 20


def _mix(z: int) -> int:
    """splitmix64 finaliser: a bijective 64-bit hash."""
    z = (z + 0x9E3779B97F4A7C15) & _MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
    return z ^ (z >> 31)


def stream_key(*parts: int) -> int:
    """A 64-bit stream key from integers, e.g. (seed, problem idx, step, candidate index)."""
    z = 0
    for p in parts:
        z = _mix(z ^ (p & _MASK))
    return z


def uniform(key: int, counter: int) -> float:
    """The counter-th uniform in [0, 1) of stream `key` (53 random bits)."""
    return (_mix(key ^ _mix(counter)) >> 11) * 2.0**-53


def entropy(logits: torch.Tensor) -> torch.Tensor:
    """Full-vocabulary entropy (nats) of softmax(logits) over the last dimension, in fp32."""
    return torch.special.entr(torch.softmax(logits.float(), dim=-1)).sum(-1)


def sample(
    logits: torch.Tensor,
    keys: Sequence[Sequence[int] | int],
    counters: Sequence[int],
    params: SamplingParams = SamplingParams(),
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row of logits [R, V]: returns (tokens LongTensor [R], entropies FloatTensor [R]).

    keys[i] is row i's stream: a tuple such as (seed, problem, step, candidate) or a precomputed
    `stream_key`; counters[i] is the index of the token being drawn (tokens the row sampled so far).
    """
    logits = logits.float()
    ent = entropy(logits)
    if params.temperature == 0:
        return logits.argmax(-1), ent
    k = logits.shape[-1] if params.top_k <= 0 else min(params.top_k, logits.shape[-1])
    vals, idx = torch.topk(logits / params.temperature, k, dim=-1, sorted=True)
    probs = torch.softmax(vals, dim=-1)
    if params.top_p < 1.0:
        mass_before = probs.cumsum(-1) - probs
        probs = probs * (mass_before < params.top_p)  # the top token always survives (mass before it is 0)
    cdf = probs.cumsum(-1)
    u = torch.tensor(
        [uniform(key if isinstance(key, int) else stream_key(*key), c) for key, c in zip(keys, counters)],
        dtype=cdf.dtype, device=cdf.device,
    )
    pick = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True).clamp_(max=k - 1)
    # A pick past the kept tokens can only come from float rounding at the very top of the cdf.
    pick = torch.minimum(pick, (probs > 0).sum(-1, keepdim=True) - 1)
    return idx.gather(-1, pick)[:, 0], ent
