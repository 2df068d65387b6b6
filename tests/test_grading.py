"""A second grader: Math-Verify's verdicts (`--grader`, `--also-grade`), the report's cross-grader table by hand,
`kvrescue grade --runs` re-grading finished folders without decoding, and the grader in a run's identity."""

from pathlib import Path

import orjson
import pytest
from typer.testing import CliRunner

from grader import grade_many
from kvrescue import grading
from kvrescue.cli import app
from kvrescue.outputs import Candidate, ModelRef, RunConfig, Step, Tokens, Trace
from tests.helpers import paper_grid, write_run

MODELS = {"base": ModelRef("Qwen/Qwen2.5-Math-7B-Instruct"), "prm": ModelRef("Qwen/Qwen2.5-Math-PRM-7B")}
# (output, raw gt, Qwen's verdict, Math-Verify's verdict), checked below against the graders themselves
ITEMS = [("so \\boxed{\\frac{1}{2}}", "0.5", True, True),
         ("\\boxed{3}", "4", False, False),
         ("The answer is $\\boxed{18}$ dollars.", "18", True, True),
         ("x = \\boxed{\\sqrt{2}/2}", "\\frac{\\sqrt{2}}{2}", True, True)]


def test_the_verdicts_used_below_are_the_graders_own():
    items = [(o, gt, "math500") for o, gt, _, _ in ITEMS]
    assert [r.correct for r in grade_many(items, timeout=10)] == [q for *_, q, _ in ITEMS]
    assert [r.correct for r in grade_many(items, timeout=10, grader="math-verify")] == [m for *_, m in ITEMS]


def _trace(idx: int, output: str, gt: str, correct: bool, graders: dict | None = None) -> Trace:
    committed = Candidate("base", 0.9, 10, "step", 1.0, 0.5, None, True)
    return Trace(idx, f"p{idx}", gt, gt, [Step("s\n\n", "base", 0.9, 10)], [[committed]], output, "x", correct,
                 False, "eos", None, Tokens(base=10), 1, {"wall_s": 1.0, "started_at": 100.0, "finished_at": 101.0},
                 20, 0, graders or {})


def _write(root: Path, seed: int, traces: list[Trace]) -> Path:
    cfg = RunConfig("math500", "bon", 64, 8, "rkv", seed, MODELS, "prm", False, {"temperature": 0.8})
    return write_run(root, cfg, traces)


def mv(correct: bool) -> dict:
    return {"math-verify": {"pred": "x", "correct": correct, "timed_out": False}}


def test_the_report_tables_both_graders_by_hand(tmp_path):
    # recorded (qwen) / math-verify verdicts over two seeds: TT, TF, FT, FF, TT, TT (one trace without a second)
    _write(tmp_path, 0, [_trace(0, "", "1", True, mv(True)), _trace(1, "", "1", True, mv(False)),
                         _trace(2, "", "1", False, mv(True))])
    _write(tmp_path, 1, [_trace(0, "", "1", False, mv(False)), _trace(1, "", "1", True, mv(True)),
                         _trace(2, "", "1", True, mv(True)), _trace(3, "", "1", True)])
    done = CliRunner().invoke(app, ["report", str(tmp_path), "--format", "json"])
    assert done.exit_code == 0, done.output
    (table,) = [t for t in orjson.loads(done.stdout)["tables"] if t["name"] == "graders"]
    (row,) = table["rows"]
    cells = dict(zip(table["columns"], row))
    assert (cells["grader"], cells["other"], cells["problems"]) == ("qwen", "math-verify", 6)
    assert cells["accuracy"] == pytest.approx(4 / 6) and cells["other accuracy"] == pytest.approx(4 / 6)
    assert [cells[c] for c in ("both correct", "only grader", "only other", "neither")] == [3, 1, 1, 1]
    md = CliRunner().invoke(app, ["report", str(tmp_path), "--format", "md"])
    assert "Cross-grader agreement" in md.stdout


def test_grade_runs_regrades_finished_folders_without_decoding(tmp_path):
    folder = _write(tmp_path, 0, [_trace(i, o, gt, not q) for i, (o, gt, q, _) in enumerate(ITEMS)])  # flipped
    before = (folder / "traces.jsonl").read_bytes()
    done = CliRunner().invoke(app, ["grade", "--runs", str(tmp_path), "--grader", "math-verify"])
    assert done.exit_code == 0, done.output
    records = [orjson.loads(line) for line in done.stdout.splitlines()]
    assert [r["idx"] for r in records] == [0, 1, 2, 3] and {r["grader"] for r in records} == {"math-verify"}
    assert [r["correct"] for r in records] == [m for *_, m in ITEMS]
    assert [r["recorded"]["correct"] for r in records] == [not q for *_, q, _ in ITEMS]
    assert all(r["folder"] == str(folder) and r["bench"] == "math500" and r["seed"] == 0 for r in records)
    assert (folder / "traces.jsonl").read_bytes() == before  # nothing written into the folder
    assert "math-verify against the recorded verdicts" in done.output  # the table, on stderr


@pytest.mark.parametrize("args, says", [
    (["grade", "--runs", "X", "--bench", "gsm8k"], "--runs grades run folders: give no JSONL and no --bench"),
    (["grade", "examples/gsm8k_outputs.jsonl"], "--bench is needed to grade a JSONL"),
    (["grade", "--runs", "EMPTY"], "no usable run folders"),
    (["grade", "examples/gsm8k_outputs.jsonl", "--bench", "gsm8k", "--grader", "sympy"], "unknown --grader 'sympy'"),
])
def test_grade_errors_are_one_line(tmp_path, args, says):
    args = [str(tmp_path) if a in ("X", "EMPTY") else a for a in args]
    done = CliRunner().invoke(app, args)
    assert done.exit_code == 2 and says in done.output and len(done.output.strip().splitlines()) == 1, done.output


def test_math_verify_missing_is_a_one_line_error_naming_the_extra(monkeypatch):
    monkeypatch.setattr(grading, "available", lambda: False)
    for args in (["grade", "examples/gsm8k_outputs.jsonl", "--bench", "gsm8k", "--grader", "math-verify"],
                 ["run", "--device", "cpu", "--also-grade", "math-verify"]):
        done = CliRunner().invoke(app, args)
        assert done.exit_code == 2, done.output
        assert "Math-Verify is not installed; pip install -e '.[math-verify]'" in done.output


def test_the_grader_is_part_of_a_runs_identity_and_qwen_keeps_old_folders():
    from kvrescue.data import ProblemSet
    from kvrescue.cell_plan import Cell
    from kvrescue.runs import cell_config

    def config(**kw) -> RunConfig:
        options = paper_grid(Path("runs"), {"base": "b", "prm": "p"}, methods=["bon"], dtype="float32", **kw)
        return cell_config(options, Cell(ProblemSet("math500", "math500", "math500", []), "bon", 64, 8, 0))

    qwen, verify = config(), config(grader="math-verify")
    assert "grader" not in qwen.settings and verify.settings["grader"] == "math-verify"
    assert qwen.digest() != verify.digest()
    assert config(also_grade=("math-verify",)).digest() == qwen.digest()  # a second verdict is not identity


def test_the_last_steps_solutions_are_graded_for_the_prm_weighted_vote():
    """The committed candidate and every other of the last step that ended with EOS record their answer and verdict
    (each read from the steps before plus its own text); candidates that ended otherwise, and earlier steps', do not."""
    from kvrescue.data import Problem
    from tests.test_search import run_all, steps_of

    script = steps_of(3, overrides={10: (1, "eos"), 11: (1, "eos"), 12: (2, "step")})  # step 1: "10", "11", "12 1"
    finished, _, _ = run_all("bon", script, {10: 0.3, 11: 0.9, 12: 0.5}, [(0, "problem", [5, 6, 7])], n=3)
    traces = []
    grading_ = grading.Grading("gsm8k", lambda trace, tokens: traces.append(trace))
    grading_.submit(finished[0], Problem(0, "problem", "110", {}))
    grading_.emit_graded(wait=True)
    (trace,) = traces
    assert trace.output == "0 1 111" and trace.pred == "111" and not trace.correct  # 11 committed, scored 0.9
    last = trace.candidates[-1]
    assert [(c.committed, c.pred, c.correct) for c in last] == [(False, "110", True), (True, "111", False),
                                                                  (False, None, None)]
    assert all(c.pred is None and c.correct is None for c in trace.candidates[0])
