"""Agreement of the two graders (Qwen2.5-Math's logic and Math-Verify) on the same items.

    .venv/bin/python benchmarks/studies/grader_agreement.py [--workers 2]

Two sets: the bundled benchmarks' reference answers graded against themselves (each raw answer boxed as the
output, as grade_bench's self-check does: both graders should say correct), and the 141 grader vectors
(tests/data: outputs graded by the official Qwen2.5-Math code, `expected` its verdict). Per set and bench it
prints the items, how many each grader calls correct, both / only Qwen / only Math-Verify / neither, and on
the vectors each grader's agreement with the official verdict.
"""

from __future__ import annotations

import argparse
import json

from benchmarks.speed.grade_bench import VECTORS, load_items
from grader import grade_many
from kvrescue.grading import check_grader
from kvrescue.report.numbers import agreement


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=3.0)
    args = parser.parse_args()
    check_grader("math-verify")
    selfcheck, vectors = load_items()
    expected = [json.loads(line)["expected"] for line in VECTORS.read_text(encoding="utf-8").splitlines()]
    print(f"{'set':<26} {'items':>6} {'qwen':>6} {'m-v':>6} {'both':>6} {'only q':>7} {'only mv':>8} "
          f"{'neither':>8} {'m-v t/o':>8}")
    for name, items in [*((f"self-check {b}", [i for i in selfcheck if i[2] == b])
                          for b in dict.fromkeys(i[2] for i in selfcheck)), ("grader vectors", vectors)]:
        qwen = grade_many(items, workers=args.workers, timeout=args.timeout)
        verify = grade_many(items, workers=args.workers, timeout=args.timeout, grader="math-verify")
        pairs = [(q.correct, v.correct) for q, v in zip(qwen, verify)]
        print(f"{name:<26} {len(items):>6} {sum(a for a, _ in pairs):>6} {sum(b for _, b in pairs):>6} "
              + " ".join(f"{c:>{w}}" for c, w in zip(agreement(pairs), (6, 7, 8, 8)))
              + f" {sum(v.timed_out for v in verify):>8}")
        if name == "grader vectors":
            print(f"  agreement with the official verdicts: qwen {sum(q.correct == e for q, e in zip(qwen, expected))}"
                  f"/{len(items)}, math-verify {sum(v.correct == e for v, e in zip(verify, expected))}/{len(items)}")


if __name__ == "__main__":
    main()
