"""`kvrescue report --explain` (the demo's closing summary): every figure against the traces it was built from."""

from pathlib import Path

from typer.testing import CliRunner

from kvrescue.cli import app
from kvrescue.outputs import Candidate, ModelRef, RunConfig, Step, Tokens, Trace
from kvrescue.report import load_runs
from kvrescue.report.explain import explain
from tests.helpers import write_run

SMOL = ModelRef("SmolLM2-135M-Instruct")
DETECTOR = {"tau_ent": 7.0, "ent_window": 12, "min_tokens": 24, "tau_cmp": 0.18, "cmp_chars": 400, "gzip_level": 9}


def trace(idx: int, correct: bool, base_prefill: int, peak: int, stops: list[Candidate],
          rows: tuple[int, int] = (40, 60)) -> Trace:
    """Two steps, base then helper (30 and 20 tokens); each step's candidates: the committed one, a plain base one,
    and the next of `stops` (base candidates the detector stopped) while there are some; `rows`: the base cache's
    entries after each step."""
    steps = [Step("a\n\n", "base", -1.0, 30, rows[0]), Step("b\n\n", "helper", -1.2, 20, rows[1])]
    cands = []
    for k, step in enumerate(steps):
        cands.append([Candidate(step.source, -1.0, step.tokens, "step", 2.0 if step.source == "base" else None,
                                0.5 if step.source == "base" else None, committed=True),
                      Candidate("base", -2.0, 30, "step", 3.5, 0.3), *stops[k:k + 1]])
    return Trace(idx, f"p{idx}", "1", "1", steps, cands, "ab", "1" if correct else "0", correct, False, "eos", None,
                 Tokens(base=150, base_prefill=base_prefill, helper=60, helper_prefill=90), 2,
                 {"wall_s": 1.0, "started_at": 10.0 + idx, "finished_at": 11.0 + idx}, peak, 0)


def write(root: Path, method: str, budget: int | None, traces: list[Trace]) -> Path:
    detector = DETECTOR if method == "kvrescue" else None
    cfg = RunConfig("gsm8k", method, budget, 2, "rkv" if budget else "none", 0,
                    {"base": SMOL, "helper": SMOL}, "helper-loglik", False,
                    {"detector": detector, "buffer": 32 if budget else None})
    return write_run(root, cfg, traces)


def test_explain_counts_steps_cache_and_detector_stops(tmp_path):
    repetition = Candidate("base", None, 120, "repetition", 4.0, 0.12, 117)
    entropy = Candidate("base", None, 40, "entropy", 7.4, 0.6, 36)
    kv = write(tmp_path, "kvrescue", 16, [trace(0, True, 70, 48, [repetition, entropy], (40, 16)),
                                          trace(1, False, 10, 30, [], (10, 30))])
    full = write(tmp_path, "full", None, [trace(0, False, 70, 120, [])])
    runs, _ = load_runs([tmp_path])
    lines = explain(runs)
    # kvrescue: base contexts 70 + 30 = 100 and 10 + 30 = 40 tokens, B' = 16 + 32 = 48: only problem 0 reached it.
    assert lines[:4] == [
        f"{full} (full N=2): 0/1 correct, steps scored by helper-loglik",
        "  committed 2 steps over 1 problem: 1 from the base, 1 from the helper",
        "  base cache: full, at most 60 entries after a commit (peak 120) for a context of up to 100 tokens",
        f"{kv} (kvrescue B=16 N=2): 1/2 correct, steps scored by helper-loglik",
    ]
    assert lines[4:] == [
        "  committed 4 steps over 2 problems: 2 from the base, 2 from the helper",
        "  base cache (rkv): at most 40 entries after a commit (peak 48) for a context of up to 100 tokens; "
        "compressed to B = 16 each time it "
        "reached B' = 48 (in 1 of 2 problems the context reached B')",
        "  detector: stopped 2 of 8 base candidates (1 entropy, 1 repetition); the first: problem 0, step 1, at "
        "token 117 (gzip ratio 0.120 < 0.18 over its last 400 characters)",
    ]


def test_explain_without_a_stop_says_how_close_the_detector_came(tmp_path):
    write(tmp_path, "kvrescue", 16, [trace(0, False, 70, 48, [])])
    runs, _ = load_runs([tmp_path])
    assert explain(runs)[-1] == ("  detector: stopped none of 3 base candidates; highest mean entropy 3.50 (fires > "
                                 "7.0), lowest gzip ratio 0.300 (fires < 0.18)")


def test_report_explain_prints_after_the_tables(tmp_path):
    write(tmp_path, "kvrescue", 16, [trace(0, True, 70, 48, [Candidate("base", None, 40, "entropy", 7.4, 0.6, 36)])])
    done = CliRunner().invoke(app, ["report", str(tmp_path), "--explain"])
    assert done.exit_code == 0, done.output
    tail = done.stdout[done.stdout.index("Run folders"):].replace("\n", " ")
    assert "detector: stopped 1 of 4 base candidates (1 entropy); the first: problem 0, step 1, at token 36 " \
           "(mean entropy 7.40 > 7.0)" in tail
    assert "detector: stopped" not in CliRunner().invoke(app, ["report", str(tmp_path)]).stdout
