"""Self-check on the five benchmark files: an output boxing a problem's own raw answer is correct."""

from __future__ import annotations

import json

import pytest

from grader import BENCHES, grade_many, raw_answer
from kvrescue.data import BUNDLED as BENCH_DIR

SIZES = {"math500": 500, "gsm8k": 1319, "aime24": 30, "amc23": 40, "olympiadbench": 675}
OUTPUT_STYLES = {
    "bare": "\\boxed{{{raw}}}",
    "sentence": "Putting it together, the answer is $\\boxed{{{raw}}}$.",
}
# Problems whose own boxed answer is NOT graded correct, as (bench, line index) -> reason.
# None: every raw answer survives extraction and normalisation identically on both sides. The known
# oddities are symmetric: e.g. math500 test/algebra/101 (`x \in [-2,7]`) normalises to `[-2,7]` on
# both sides because the gt goes through the prediction pipeline, and gts that strip_string mangles
# (`\text{east}` -> ``, `15\mbox{ cm}^2` -> `15^2`) are mangled the same way in the prediction.
EXCEPTIONS: dict[tuple[str, int], str] = {}


def load(bench: str) -> list[dict]:
    lines = (BENCH_DIR / f"{bench}.jsonl").read_text(encoding="utf-8").splitlines()
    return [json.loads(line) for line in lines if line.strip()]


@pytest.mark.parametrize("style", sorted(OUTPUT_STYLES))
def test_own_answer_graded_correct(style: str) -> None:
    keys, items = [], []
    for bench in BENCHES:
        records = load(bench)
        assert len(records) == SIZES[bench]
        for i, record in enumerate(records):
            raw = raw_answer(record, bench)
            keys.append((bench, i))
            items.append((OUTPUT_STYLES[style].format(raw=raw), raw, bench))
    assert len(items) == 2564
    results = grade_many(items, workers=2)
    failures = {key: r for key, r in zip(keys, results) if not r.correct}
    assert set(failures) == set(EXCEPTIONS), failures
    assert not any(r.timed_out for r in results)


def test_raw_answers_follow_the_harness() -> None:
    assert raw_answer(load("gsm8k")[0], "gsm8k").strip() == "18"
    assert raw_answer(load("amc23")[0], "amc23") == "27.0"
    aime = {r["answer"]: raw_answer(r, "aime24") for r in load("aime24")}
    assert aime["025"] == "025"
    olympiad = [raw_answer(r, "olympiadbench") for r in load("olympiadbench")]
    assert not any(a.startswith("$") or a.endswith("$") for a in olympiad)
    math500 = {r["unique_id"]: raw_answer(r, "math500") for r in load("math500")}
    assert math500["test/algebra/101.json"] == "x \\in [-2,7]"
