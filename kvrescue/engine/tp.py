"""Tensor parallelism in the engine's own decoder, Megatron style (after gpt-fast's tp.py).

The K ranks of a tensor-parallel group run every forward together. A model is sharded over d ranks:
- q/k/v and gate/up are column-parallel (rank r holds query heads r*Hq/d.., its KV heads and 1/d of
  the MLP columns), o and down are row-parallel, each followed by one all-reduce;
- the embedding and the LM head are vocab-parallel (rank r holds rows r*ceil(V/d)..; the embedding
  all-reduces, the head all-gathers the logits): replicated, they would be 2 x 152064 x 8192 bf16 =
  5 GB of each 40 GB device for the 72B base, where sharded they take 0.6 GB;
- norms and the PRM's score head (H x H and H x 2) are replicated.

d (`shapes.shard_degree`) is the largest divisor of K that divides the query heads and the MLP width and either divides
the KV heads or is a multiple of them; in the latter case d / Hkv consecutive ranks hold the same KV
head (KV-head replication, as vLLM does when TP exceeds the KV head count). With d < K, the K/d
subgroups of d consecutive ranks each hold a whole copy and compute the same thing, so every rank
holds 1/d of the model. In the paper's setting (K = 8) the 72B base (64/8 heads) is sharded 8 ways,
the 7B PRM (28/4) 4 ways, the 1.5B helper (12/2) 4 ways with each KV head on two ranks. The base's
evicting cache scores each KV head with its whole query group, so a base must have d = K without
replication (`exact_heads`): anything else is refused before loading.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from kvrescue.model_config import ModelArgs


@dataclass(frozen=True)
class Shard:
    """This rank's place in the d ranks that share one copy of a model (d = 1: not sharded)."""

    rank: int = 0
    size: int = 1
    group: Any = None  # the torch.distributed process group of the d ranks

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum of x over the shard's ranks, in place."""
        if self.size > 1:
            dist.all_reduce(x, group=self.group)
        return x

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """The ranks' x concatenated along the last dimension, rank order."""
        if self.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)

    def rows(self, n: int) -> tuple[int, int]:
        """(start, count) of this rank's rows of a dimension of n split into d equal padded parts."""
        per = -(-n // self.size)
        return self.rank * per, per

    def kv_heads(self, n_kv_heads: int) -> tuple[int, int]:
        """(first, count) of the KV heads this rank holds (one, shared by d / Hkv ranks, when d > Hkv)."""
        if self.size > n_kv_heads:
            return self.rank // (self.size // n_kv_heads), 1
        per = n_kv_heads // self.size
        return self.rank * per, per

    @property
    def copied(self) -> bool:
        """Whether other ranks of the group hold other whole copies of this model (d < K): their forwards may
        differ in the last bits (atomic adds on a GPU), so decisions from its outputs come from rank 0."""
        return dist.is_initialized() and self.size < dist.get_world_size()


def from_rank_0(x: torch.Tensor) -> torch.Tensor:
    """`x` (contiguous, on this rank's device) as global rank 0 of the group holds it: one place takes each
    decision (a sampled token, a score) that ranks could otherwise take differently, so that every rank then
    issues the same collectives. `x` itself outside a group."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast(x, src=0)
    return x


def values_from_rank_0(values: list[float]) -> list[float]:
    """`values` (as many on every rank) as global rank 0 computed them (`from_rank_0`)."""
    if not values or not (dist.is_initialized() and dist.get_world_size() > 1):
        return values
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    return from_rank_0(torch.tensor(values, dtype=torch.float64, device=device)).tolist()


_groups: dict[int, Any] = {}  # each shard degree's subgroup of this process, in the group now initialised


def forget_groups() -> None:
    """Drop the subgroups of a destroyed process group: a group formed later in this process makes its own (its
    other ranks, fresh processes, create them; this rank reusing the old ones left them waiting)."""
    _groups.clear()


def make_shard(d: int) -> Shard:
    """This process's Shard of a model sharded over d ranks of the initialised torch.distributed group."""
    if d == 1:
        return Shard()
    k, rank = dist.get_world_size(), dist.get_rank()
    if d not in _groups:
        # every rank creates every subgroup, in the same order (torch.distributed requires it)
        subgroups = [dist.new_group(list(range(s, s + d))) for s in range(0, k, d)]
        _groups[d] = subgroups[rank // d] if d < k else dist.group.WORLD
    return Shard(rank % d, d, _groups[d])


def shard_weight(name: str, weight: Any, args: ModelArgs, shard: Shard) -> torch.Tensor:
    """This rank's part of a Hugging Face checkpoint tensor `name`, read from `weight` (a tensor or a
    safetensors slice, so only that part is read from disk). `args` are the checkpoint's shapes."""
    if shard.size == 1:
        return weight[:]
    r, hd = shard.rank, args.head_dim
    q_cols, mlp_cols = args.n_heads // shard.size * hd, args.intermediate_size // shard.size
    kv_first, kv_count = shard.kv_heads(args.n_kv_heads)
    leaf = name.rsplit(".", 2)[-2]  # q_proj, o_proj, embed_tokens, ...
    if leaf == "q_proj":  # column-parallel: rows of the weight (and of the bias)
        return weight[r * q_cols:(r + 1) * q_cols]
    if leaf in ("k_proj", "v_proj"):
        return weight[kv_first * hd:(kv_first + kv_count) * hd]
    if leaf in ("gate_proj", "up_proj"):
        return weight[r * mlp_cols:(r + 1) * mlp_cols]
    if leaf == "o_proj":  # row-parallel: columns
        return weight[:, r * q_cols:(r + 1) * q_cols]
    if leaf == "down_proj":
        return weight[:, r * mlp_cols:(r + 1) * mlp_cols]
    if leaf in ("embed_tokens", "lm_head"):  # vocab-parallel, the last part padded with zero rows
        start, rows = shard.rows(args.vocab_size)
        part = weight[start:start + rows]
        return torch.cat([part, part.new_zeros(rows - part.shape[0], part.shape[1])])
    return weight[:]
