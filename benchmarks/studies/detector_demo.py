"""The degeneration detector on a real model: SmolLM2-135M-Instruct on a few GSM8K problems.

For each problem and evictor, a stepwise loop samples N candidates per step from the evicted base
cache, runs the detector on each (it stops a candidate as soon as it fires), and commits the first
candidate that survived (the first one if none did; no PRM here). Prints how often each test fired,
per evictor, so eviction-induced degeneration can be seen on a CPU. No count is asserted.

    .venv/bin/python benchmarks/studies/detector_demo.py --problems 4 --n 4 --budget 16
"""

from __future__ import annotations

import argparse
import json
import time
from collections import Counter

import torch

from kvrescue.data import BUNDLED
from kvrescue.detect import DetectorConfig
from kvrescue.engine.bounded import BoundedCache
from kvrescue.engine.caches import FullCache
from kvrescue.engine.loader import LoadedModel, load_model
from kvrescue.engine.runner import Runner
from kvrescue.engine.steps import StepRules
from kvrescue.smollm import smollm2_folder
from tests.oracles import generate_steps

SYSTEM = "Please reason step by step, and put your final answer within \\boxed{}."
GSM8K = BUNDLED / "gsm8k.jsonl"


def run_problem(model: LoadedModel, question: str, idx: int, policy: str, args) -> tuple[Counter, list[float], list[float]]:
    """Stepwise decoding of one problem; returns finish-reason counts and each candidate's max H-bar / min rho."""
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
    prompt = model.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = model.tokenizer(prompt, add_special_tokens=False)["input_ids"]
    if policy == "none":  # the full cache, as `kvrescue run --evictor none` keeps: the root and N candidates
        cache = FullCache.for_model(model.net, (args.n + 1) * (len(ids) + args.max_tokens + 64), max_rows=args.n + 1)
    else:
        cache = BoundedCache.for_model(model.net, budget=args.budget, evictor=policy)
    runner = Runner(model, cache)
    (root,) = runner.prefill([ids])
    rules = StepRules(frozenset(model.eos_ids), max_context=len(ids) + args.max_tokens,
                      detector=DetectorConfig(tau_ent=args.tau_ent, tau_cmp=args.tau_cmp))
    reasons, max_ent, min_rho = Counter(), [], []
    generated, step = 0, 0
    while generated < args.max_tokens:
        kids = runner.fork(root, args.n)
        results = generate_steps(runner, kids, [(args.seed, idx, step, c) for c in range(len(kids))], rules,
                                 screened=[True] * len(kids))
        for res in results:
            reasons[res.finish] += 1
            if res.max_mean_entropy is not None:
                max_ent.append(res.max_mean_entropy)
            if res.min_gzip_ratio is not None:
                min_rho.append(res.min_gzip_ratio)
        survivors = [c for c, res in enumerate(results) if res.fired_at is None]
        win = survivors[0] if survivors else 0
        runner.adopt(root, kids[win])
        runner.release([k for c, k in enumerate(kids) if c != win])
        committed = results[win]
        generated += len(committed.tokens)
        step += 1
        if committed.finish in ("eos", "length") or generated >= args.max_tokens:
            break
        runner.commit([root], [committed.tokens])
    return reasons, max_ent, min_rho


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--problems", type=int, default=4)
    ap.add_argument("--n", type=int, default=4, help="candidates per step")
    ap.add_argument("--budget", type=int, default=16)
    ap.add_argument("--policies", default="rkv,none")
    ap.add_argument("--max-tokens", type=int, default=600, help="generated tokens per problem")
    ap.add_argument("--tau-ent", type=float, default=7.0)
    ap.add_argument("--tau-cmp", type=float, default=0.18)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    torch.manual_seed(args.seed)
    model = load_model(smollm2_folder())
    with open(GSM8K) as f:
        questions = [json.loads(line)["question"] for _, line in zip(range(args.problems), f)]
    for policy in args.policies.split(","):
        t0 = time.perf_counter()
        total, ents, rhos = Counter(), [], []
        for idx, q in enumerate(questions):
            reasons, e, r = run_problem(model, q, idx, policy, args)
            print(f"  [{policy}] problem {idx}: " + ", ".join(f"{k} {v}" for k, v in sorted(reasons.items())), flush=True)
            total += reasons
            ents += e
            rhos += r
        n = sum(total.values())
        label = f"{policy} B={args.budget}" if policy != "none" else "none (full cache)"
        print(f"{label}: {n} candidates over {len(questions)} problems in {time.perf_counter() - t0:.0f} s")
        for reason in ("step", "eos", "length", "entropy", "repetition"):
            print(f"  {reason:<10} {total[reason]:4d}  ({total[reason] / max(n, 1):.1%})")
        if ents:
            print(f"  max mean entropy per candidate: median {sorted(ents)[len(ents) // 2]:.2f}, max {max(ents):.2f} nats")
        if rhos:
            print(f"  min gzip ratio per candidate:   median {sorted(rhos)[len(rhos) // 2]:.3f}, min {min(rhos):.3f}")


if __name__ == "__main__":
    main()
