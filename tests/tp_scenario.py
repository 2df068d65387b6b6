"""One fixed workload run on one device and, as `python -m tests.tp_scenario`, on each rank of a gloo group.

Every output is teacher-forced (fixed tokens, no sampling), so one device's results and each rank's
are comparable entry by entry: logits (gathered, so every rank has them whole), PRM scores, and the
positions the evicting cache kept per layer and KV head (the rank's own heads).
"""

import sys
from pathlib import Path
from unittest.mock import patch

import torch
import torch.distributed as dist

from kvrescue.engine import FullCache, load_model
from kvrescue.engine import compression
from kvrescue.engine.bounded import BoundedCache
from kvrescue.engine.graphs import StaticDecode
from kvrescue.engine.prm import PRMScorer
from tests.oracles import prm_scores

BUDGET, SLACK = 16, 8
PROBLEM = "What is 3x + 5 = 20 for x?"
STEPS = ["Step 1: 3x = 15.\n\n", "Step 2: Dividing both sides by 3 gives x = 5.\n\n", "The answer is \\boxed{5}."]


def _tokens(vocab: int, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    return torch.randint(0, vocab, shape, generator=torch.Generator().manual_seed(seed))


def _cached(net, cache, prompt_lengths: list[int], steps: int, seed: int, static: bool = False) -> list[torch.Tensor]:
    """Logits of a right-padded prefill of rows of different lengths, then `steps` one-token decodes
    (through the bounded cache's static decode step with `static`)."""
    vocab = net.args.vocab_size
    rows = [cache.create() for _ in prompt_lengths]
    out = [net.prefill(_tokens(vocab, (len(rows), max(prompt_lengths)), seed), cache, rows, prompt_lengths, last_only=False)]
    decode = _tokens(vocab, (steps, len(rows)), seed + 1)
    step = StaticDecode(net, cache, graphs=False) if static else None
    out += [step(rows, decode[t].tolist()) if step else net.decode(decode[t], cache, rows) for t in range(steps)]
    return out


def kept_positions(net, policy: str, prompt_lengths: list[int], steps: int, seed: int) -> list[torch.Tensor]:
    """What every compression of the cached workload kept: the policy's result [layers, rows, kv_heads,
    budget] (indices of the entries each row held), recorded around the cache's own call."""
    calls, policy_keep = [], compression.keep_positions

    def recording(*args):
        calls.append(policy_keep(*args))
        return calls[-1]

    with patch.object(compression, "keep_positions", recording):
        _cached(net, BoundedCache.for_model(net, BUDGET, policy, buffer=SLACK, rows=4), prompt_lengths, steps, seed)
    return calls


@torch.inference_mode()
def run(base_dir: Path, helper_dir: Path, prm_dir: Path, tp: int = 1) -> dict[str, object]:
    """The workload on this process's models (sharded over the `tp` ranks of the initialised group)."""
    base = load_model(base_dir, tp=tp, exact_heads=True)
    helper = load_model(helper_dir, tp=tp)
    prm = load_model(prm_dir, tp=tp)
    lengths = [27, 9, 18]
    out: dict[str, object] = {
        "plain": base.logits(_tokens(base.args.vocab_size, (2, 12), 0)),
        "full": _cached(base.net, FullCache.for_model(base.net, 512, max_rows=8, block_size=4), lengths, 6, 1),
        "bounded": _cached(base.net, BoundedCache.for_model(base.net, BUDGET, "rkv", buffer=SLACK, rows=4), lengths, 30, 2),
        "static": _cached(base.net, BoundedCache.for_model(base.net, BUDGET, "rkv", buffer=SLACK, rows=4), lengths, 30, 2,
                          static=True),
        "kept": kept_positions(base.net, "rkv", lengths, 30, 2),
        "kept_h2o": kept_positions(base.net, "h2o", lengths, 30, 2),  # each rank accumulates for its own KV heads
        "helper": _cached(helper.net, FullCache.for_model(helper.net, 512, max_rows=8, block_size=4), lengths, 6, 3),
        "prm_plain": prm_scores(prm, PROBLEM, STEPS),
    }
    scorer = PRMScorer(prm, max_problems=2, max_candidates=4)
    scorer.open(0, PROBLEM)
    scorer.commit(0, STEPS[0])
    out["prm_cached"] = scorer.score([(0, s, []) for s in STEPS[1:]])
    out["shapes"] = {name: (m.args.n_heads, m.args.n_kv_heads, m.net.shard.size) for name, m in
                     (("base", base), ("helper", helper), ("prm", prm))}
    out["parameters"] = sum(p.numel() for m in (base, helper, prm) for p in m.net.parameters())
    return out


if __name__ == "__main__":
    rank, world, rendezvous, result, *dirs = sys.argv[1:]
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=int(rank), world_size=int(world))
    try:
        torch.save(run(*map(Path, dirs), tp=int(world)), result)
    finally:
        dist.destroy_process_group()
