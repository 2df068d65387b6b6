"""How often the two PRM recipes (`--prm-format paper` and `model-card`) pick a different candidate at a step.

`kvrescue run` decodes a few GSM8K problems with SmolLM2-135M-Instruct (`--method full`, N candidates a step),
scored by a random PRM checkpoint (the tests' shape, seed 3) with the paper's recipe. Every step's candidates are
then scored again along the committed trajectory with each recipe by the product's `PRMScorer`, and the script
prints the share of steps whose best candidate (the first on ties) differs between the recipes. The paper-recipe
rescoring must reproduce the scores the run recorded. A random PRM says how much the input format alone moves a
scorer's choices, not which recipe scores better.

    .venv/bin/python benchmarks/studies/prm_recipes.py --problems 8 --n 4 --max-steps 8
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

import orjson

from kvrescue.engine import load_model
from kvrescue.engine.loader import LoadedModel
from kvrescue.engine.prm import PRMScorer
from kvrescue.engine.prm_recipes import FORMATS
from kvrescue_testkit.random_checkpoints import write_random_checkpoint
from kvrescue.smollm import smollm2_folder

KVRESCUE = str(Path(sys.executable).parent / "kvrescue")


def decode(out: Path, prm_dir: Path, args: argparse.Namespace) -> list[dict]:
    """The run's traces (one per problem), decoded with the paper's recipe."""
    subprocess.run([KVRESCUE, "run", "--bench", "gsm8k", "--limit", str(args.problems), "--method", "full",
                    "--n", str(args.n), "--base", str(smollm2_folder()), "--prm", str(prm_dir), "--prm-format",
                    "paper", "--max-steps", str(args.max_steps), "--max-step-tokens", str(args.max_step_tokens),
                    "--device", "cpu", "--dtype", "float32", "--out", str(out)], check=True)
    (traces,) = out.glob("*/*/traces.jsonl")
    return [orjson.loads(line) for line in traces.read_bytes().splitlines()]


def winners(prm: LoadedModel, trace: dict, recipe: str) -> tuple[list[int], list[list[float]]]:
    """Each step's best candidate and all its scores, scored along the committed trajectory with `recipe`."""
    scorer = PRMScorer(prm, max_problems=1, max_candidates=32, recipe=FORMATS[recipe])
    scorer.open(0, trace["problem"], [])
    best, scores = [], []
    for step, cands in zip(trace["steps"], trace["candidates"]):
        texts = [step["text"] if c["committed"] else c["text"] for c in cands]
        got = scorer.score([(0, text, []) for text in texts])
        best.append(max(range(len(got)), key=got.__getitem__))
        scores.append(got)
        scorer.commit(0, step["text"], [])
    scorer.close(0)
    return best, scores


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--problems", type=int, default=8)
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--max-steps", type=int, default=8)
    ap.add_argument("--max-step-tokens", type=int, default=64)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        prm_dir = write_random_checkpoint(Path(tmp) / "prm", "prm", seed=3, hidden_size=64, num_layers=2,
                                          num_heads=4, num_kv_heads=2, intermediate_size=128, init_std=0.1)
        traces = decode(Path(tmp) / "runs", prm_dir, args)
        prm = load_model(prm_dir)
        steps = changed = 0
        for trace in traces:
            paper, paper_scores = winners(prm, trace, "paper")
            card, _ = winners(prm, trace, "model-card")
            recorded = [[c["score"] for c in cands] for cands in trace["candidates"]]
            worst = max(abs(a - b) for got, want in zip(paper_scores, recorded) for a, b in zip(got, want))
            assert worst < 1e-4, f"problem {trace['idx']}: rescoring with the paper's recipe is off by {worst:g}"
            steps += len(paper)
            changed += sum(a != b for a, b in zip(paper, card))
    print(f"{len(traces)} problems, {steps} steps of {args.n} candidates: the winner changes between the recipes at "
          f"{changed} steps ({100 * changed / steps:.1f}%; {100 * (1 - 1 / args.n):.0f}% for unrelated choices)")


if __name__ == "__main__":
    main()
