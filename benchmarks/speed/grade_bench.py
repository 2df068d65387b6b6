"""Grader throughput: the 2,564 self-check outputs plus the 141 grader vectors, with 1 and 2 workers.

    .venv/bin/python benchmarks/speed/grade_bench.py

The set is dealt into three interleaved thirds of the same make-up. For each worker count: cold (fresh
sympy workers started inside the timing) grades the first third, warm grades the second on those same
workers, and then the sympy items of the last third alone, warm. Every timed pass grades items its
workers have never seen (sympy caches what it parsed: re-grading the same items would be ~1.6x faster);
which items need sympy is found first, in workers that are shut down before any timing. It prints
items/s, the share of items that needed the sympy path (the only ones that leave the calling process),
and timeouts.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from grader import BENCHES, grade_many, raw_answer, shutdown
from kvrescue.data import BUNDLED

VECTORS = Path(__file__).resolve().parents[2] / "tests" / "data" / "grader_vectors.jsonl"

Item = tuple[str, str, str]


def load_items() -> tuple[list[Item], list[Item]]:
    """Self-check items (each bundled problem's raw answer, boxed) and the vector items (tests/data)."""
    selfcheck = []
    for bench in BENCHES:
        for line in (BUNDLED / f"{bench}.jsonl").read_text(encoding="utf-8").splitlines():
            raw = raw_answer(json.loads(line), bench)
            selfcheck.append((f"The answer is $\\boxed{{{raw}}}$.", raw, bench))
    vectors = [json.loads(line) for line in (VECTORS).read_text(encoding="utf-8").splitlines()]
    return selfcheck, [(v["output"], v["gt"], v["bench"]) for v in vectors]


def timed(items: list[Item], workers: int) -> tuple[float, list]:
    start = time.perf_counter()
    results = grade_many(items, workers=workers)
    return time.perf_counter() - start, results


def report(label: str, items: list[Item], workers: int, seconds: float, results: list) -> None:
    symbolic = sum(r.symbolic for r in results)
    print(
        f"{label:<22} workers={workers}  items={len(items):>5}  {seconds:7.2f} s  {len(items) / seconds:8.1f} items/s"
        f"  symbolic {symbolic:>3} ({symbolic / len(items):6.2%})  timeouts {sum(r.timed_out for r in results)}"
        f"  correct {sum(r.correct for r in results)}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.parse_args()
    selfcheck, vectors = load_items()
    items = selfcheck + vectors
    cold, warm, rest = items[0::3], items[1::3], items[2::3]
    symbolic = [item for item, r in zip(rest, grade_many(rest, workers=2)) if r.symbolic]
    for workers in (1, 2):
        shutdown()  # fresh workers: nothing parsed yet
        report("cold start", cold, workers, *timed(cold, workers))
        report("warm, fresh items", warm, workers, *timed(warm, workers))
        report("sympy items only, warm", symbolic, workers, *timed(symbolic, workers))
    shutdown()


if __name__ == "__main__":
    main()
