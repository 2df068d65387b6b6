"""`kvrescue report` against the paper's own summary figures, from run folders written by the real outputs code.

Where the numbers come from (the paper itself could not be read this session: the search tools hold summaries of
arXiv 2608.15797, not its tables, so every per-setting value the issue does not state is constructed, and says so):
- Recovery, "87.4% at B = 64": the average of Table 5's 20 R-KV settings (5 benches x 2 base models x N in {1, 8}),
  as issue 42 states it. Table 5's per-setting accuracies are not in the issue: the folders here are constructed so
  that the 20 settings' recoveries average 87.4% (19 settings at 35/40, one at 34/40: 699/800 = 87.375%).
- Base tokens, "-43.4%": Table 1's per-benchmark reductions at B = 64 as issue 42 quotes them (40.2, 34.0, 38.4,
  63.1, 41.3; their mean 43.4%). Which bench has which reduction is not in the issue (the mean does not depend on
  it), and the absolute token counts are constructed (so the pooled change here is not the paper's 40.6%).
- Degeneration, Table 2: the three pairs issue 42 gives, each a count over all 500 MATH500 problems and the same count
  over the incorrect ones: 2.4% / 15.0% (full-KV: 12 of 500, 12 of 80 incorrect), 13.4% / 28.4% (best-of-N at
  B = 64: 67 of 500, 67 of 236 incorrect) and 0.2% / 1.1% at 82.2% accuracy (1 of 500, 1 of 89). The counts and
  accuracies follow from those pairs; the issue does not name the row of the third, placed here as KV-Rescue's.
"""

from pathlib import Path

import orjson
import pytest
from typer.testing import CliRunner

from kvrescue.cli import app
from kvrescue.outputs import Candidate, ModelRef, RunConfig, Step, Tokens, Trace
from tests.helpers import write_run

HELPER, PRM = "Qwen/Qwen2.5-Math-1.5B-Instruct", "Qwen/Qwen2.5-Math-PRM-7B"
BASES = ("Qwen/Qwen2.5-Math-7B-Instruct", "Qwen/Qwen2.5-Math-72B-Instruct")
BENCHES = ("math500", "gsm8k", "aime24", "amc23", "olympiadbench")
ROLES = {"full": ("base", "prm"), "bon": ("base", "prm"), "interleave": ("base", "helper", "prm"),
         "kvrescue": ("base", "helper", "prm")}


def config(bench: str, method: str, *, base: str = BASES[0], n: int = 8, budget: int = 64,
           evictor: str = "rkv") -> RunConfig:
    models = {"base": ModelRef(base), "helper": ModelRef(HELPER), "prm": ModelRef(PRM)}
    evicted = method != "full"
    return RunConfig(bench, method, budget if evicted else None, n, evictor if evicted else "none", 0,
                     {role: models[role] for role in ROLES[method]}, "prm", False,
                     {"detector": {"tau_ent": 7.0, "tau_cmp": 0.18} if method == "kvrescue" else None})


def trace(idx: int, correct: bool, steps: int = 2, base_tokens: int = 20) -> Trace:
    """One problem: `steps` base steps, a boxed answer, `base_tokens` base tokens generated."""
    return Trace(idx, f"p{idx}", "1", "1", [Step(f"s{i}\n\n", "base", 0.9, 10) for i in range(steps)],
                 [[Candidate("base", 0.9, 10, "step", committed=True)] for _ in range(steps)],
                 "\\boxed{1}" if correct else "\\boxed{0}", "1" if correct else "0", correct, False, "eos", None,
                 Tokens(base=base_tokens), steps, {"wall_s": 1.0, "started_at": float(idx), "finished_at": idx + 1.0},
                 100, 0)


def write(root: Path, cfg: RunConfig, correct: int, problems: int, **fields) -> Path:
    return write_run(root, cfg, (trace(i, i < correct, **fields) for i in range(problems)))


def report(root: Path, fmt: str) -> str:
    done = CliRunner().invoke(app, ["report", str(root), "--format", fmt])
    assert done.exit_code == 0, done.output
    return done.stdout


def table(data: dict, name: str) -> list[dict]:
    t = next(t for t in data["tables"] if t["name"] == name)
    return [dict(zip(t["columns"], row)) for row in t["rows"]]


def test_average_recovery_at_b64_is_the_papers_87_4_percent_over_its_20_settings(tmp_path):
    gap = 40  # problems: full solves all, bon none, so a setting's recovery is kvrescue's correct / 40
    settings = [(bench, base, n) for bench in BENCHES for base in BASES for n in (1, 8)]
    for i, (bench, base, n) in enumerate(settings):
        write(tmp_path, config(bench, "full", base=base, n=n), gap, gap)
        write(tmp_path, config(bench, "bon", base=base, n=n), 0, gap)
        write(tmp_path, config(bench, "kvrescue", base=base, n=n), 34 if i == 0 else 35, gap)
    # beside them, what the paper's average leaves out: SnapKV settings (Figure 10) and another budget
    for bench in BENCHES[:2]:
        write(tmp_path, config(bench, "bon", evictor="snapkv"), 0, gap)
        write(tmp_path, config(bench, "kvrescue", evictor="snapkv"), 10, gap)
        write(tmp_path, config(bench, "bon", budget=128), 0, gap)
        write(tmp_path, config(bench, "kvrescue", budget=128), 20, gap)
    means = {(m["evictor"], m["budget"], m["base"]): m for m in table(orjson.loads(report(tmp_path, "json")),
                                                                      "recovery_mean")}
    rkv = means[("rkv", 64, "all")]
    assert rkv["recovery"] == pytest.approx(699 / 800) and round(100 * rkv["recovery"], 1) == 87.4
    assert (rkv["settings"], rkv["benches"], rkv["base models"], rkv["N"]) == ("20/20", 5, 2, "1,8")
    assert means[("rkv", 64, BASES[0])]["recovery"] == pytest.approx(349 / 400)      # per base model too
    assert means[("rkv", 64, BASES[1])]["recovery"] == pytest.approx(350 / 400)
    assert means[("snapkv", 64, "all")]["recovery"] == pytest.approx(0.25)
    assert means[("rkv", 128, "all")]["recovery"] == pytest.approx(0.5)
    assert "| rkv | 64 | all | 20/20 | 5 | 2 | 1,8 | 87.4 |" in report(tmp_path, "md")


TABLE_1_REDUCTIONS = (40.2, 34.0, 38.4, 63.1, 41.3)   # percent, B = 64 (issue 42's quotation of Table 1)


def test_base_tokens_mean_change_at_b64_is_the_papers_minus_43_4_percent(tmp_path):
    bon_tokens = (1000, 2000, 3000, 4000, 5000)          # constructed: Table 1's absolute counts are not in the issue
    for bench, cut, tokens in zip(BENCHES, TABLE_1_REDUCTIONS, bon_tokens):
        write(tmp_path, config(bench, "full", n=8), 1, 2, base_tokens=9 * tokens)
        write(tmp_path, config(bench, "bon"), 1, 2, base_tokens=tokens)
        write(tmp_path, config(bench, "kvrescue"), 1, 2, base_tokens=round(tokens * (1 - cut / 100)))
    data = orjson.loads(report(tmp_path, "json"))
    (row,) = table(data, "token_change")
    assert row["benches"] == 5 and round(100 * row["mean Δ base tokens"], 1) == -43.4
    kept = sum(round(t * (1 - c / 100)) for t, c in zip(bon_tokens, TABLE_1_REDUCTIONS))
    assert row["pooled Δ base tokens"] == pytest.approx(kept / sum(bon_tokens) - 1)     # -45.5%: another reading
    assert "| rkv | Qwen/Qwen2.5-Math-7B-Instruct | 8 | 64 | 5 | -43.4 | -45.5 |" in report(tmp_path, "md")
    full = [r for r in table(data, "cost") if r["method"] == "full"]
    assert len(full) == 5 and full[0]["base tokens"]["mean"] > 0                     # Table 1's full-KV rows


# (method, problems correct, degenerate): 500 MATH500 problems each, degenerate ones incorrect with 256 steps
TABLE_2 = (("full", 420, 12), ("bon", 264, 67), ("kvrescue", 411, 1))


def test_degeneration_is_table_2s_column(tmp_path):
    for method, correct, degenerate in TABLE_2:
        traces = [trace(i, i < correct, steps=256 if i >= 500 - degenerate else 2) for i in range(500)]
        write_run(tmp_path, config("math500", method), traces)
    md = report(tmp_path, "md")
    # accuracy, degeneration over all problems (the table's numbers), over the incorrect ones (its caption)
    assert "| full | 8 | — | 84.0 | 2.4 | 15.0 |" in md
    assert "| bon | 8 | 64 | 52.8 | 13.4 | 28.4 |" in md
    assert "| kvrescue | 8 | 64 | 82.2 | 0.2 | 1.1 |" in md
