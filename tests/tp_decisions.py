"""One cell decoded on each rank of a gloo group (`python -m tests.tp_decisions`), where rank 1's copies of the
helper (held whole on each rank: its 3 heads do not split over 2) and of the scorer compute slightly different
numbers, as two subgroups' GPUs may; every rank must still take rank 0's decisions."""

import pickle
import sys
from datetime import timedelta
from pathlib import Path

import orjson
import torch
import torch.distributed as dist

from kvrescue.cell_runners import build_cell
from kvrescue.decoding import decode_cell
from kvrescue.group_models import load_roles
from kvrescue.engine.prm import PRMScorer
from kvrescue.engine.runner import Runner


def disagree() -> None:
    """Rank 1's helper logits and PRM scores move by noise (near-ties then go the other way)."""
    sample, score, noise = Runner.sample, PRMScorer.score, torch.Generator().manual_seed(1)

    def noisy_sample(self, rows, draws, params):
        if not self.model.net.shard.size > 1:  # a whole copy on this rank
            self.logits += torch.randn(self.logits.shape, generator=noise)
        return sample(self, rows, draws, params)

    def noisy_score(self, requests):
        return [s + 0.3 * torch.randn((), generator=noise).item() for s in score(self, requests)]

    Runner.sample, PRMScorer.score = noisy_sample, noisy_score


def decisions(trace) -> dict:
    """What a rank decided for a problem: its steps (text, source, score), each candidate's finish and tokens."""
    return {"idx": trace.idx, "steps": [(s.text, s.source, s.score) for s in trace.steps],
            "candidates": [[(c.source, c.finish, c.tokens, c.score) for c in cands] for cands in trace.candidates],
            "output": trace.output}


if __name__ == "__main__":
    rank, world, rendezvous, setup, out = sys.argv[1:]
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=int(rank), world_size=int(world),
                            timeout=timedelta(seconds=60))  # a rank left waiting by a diverged one fails soon
    options, cell = pickle.loads(Path(setup).read_bytes())
    models = load_roles(options.group_plan(), "cpu")
    if rank == "1":
        disagree()
    made = []
    try:
        plan = options.plan_of(cell)
        decode_cell(plan, cell, build_cell(plan, models), cell.problems.problems,
                    lambda trace, tokens: made.append(decisions(trace)))
    finally:
        Path(out).write_bytes(orjson.dumps(made))
        dist.destroy_process_group()
