"""`kvrescue report`: every table number against a hand computation, all formats, the plot, bad input."""

import csv
import io
import math
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import orjson
import pytest
from typer.testing import CliRunner

from kvrescue.cli import app
from kvrescue.outputs import (
    Candidate, ModelRef, RunConfig, RunFolder, Step, Tokens, Trace, run_dir,
)
from kvrescue.report import QUANTILES, load_runs
from kvrescue.report.numbers import group_rows, quantiles
from tests.helpers import kvrescue

MODELS = {"base": ModelRef("Qwen/Qwen2.5-Math-7B-Instruct"), "helper": ModelRef("Qwen/Qwen2.5-Math-1.5B-Instruct"),
          "prm": ModelRef("Qwen/Qwen2.5-Math-PRM-7B")}
ROLES = {"full": ("base", "prm"), "bon": ("base", "prm"), "helper": ("helper", "prm"),
         "interleave": ("base", "helper", "prm"), "kvrescue": ("base", "helper", "prm")}
VENV_KVRESCUE = Path(sys.executable).parent / "kvrescue"


def make_trace(idx: int, correct: bool, sources: str, ent: float = 1.0) -> Trace:
    """Steps from `sources` ("b"/"h"); each step: a committed candidate, one other base candidate (its
    max mean entropy `ent + 5`, stopped by the detector when sources[i] is "b" and i == 0) and a helper one.
    Base tokens: 10 per base candidate; helper tokens: 10 per helper candidate."""
    steps, cands = [], []
    for i, s in enumerate(sources):
        src = "base" if s == "b" else "helper"
        steps.append(Step(f"s{i}\n\n", src, 0.9, 10))
        exit_ = i == 0 and s == "b"
        cands.append([
            Candidate("base", 0.9 if src == "base" else 0.1, 10, "step", ent, 0.5, None, src == "base"),
            Candidate("base", None if exit_ else 0.2, 10, "entropy" if exit_ else "step", ent + 5, 0.4,
                      10 if exit_ else None),
            Candidate("helper", 0.9 if src == "helper" else 0.0, 10, "step", committed=src == "helper"),
        ])
    output = "\\boxed{1}" if correct else "\\boxed{0}"
    return Trace(idx, f"p{idx}", "1", "1", steps, cands, output, "1" if correct else "0", correct, False, "eos", None,
                 Tokens(base=20 * len(sources), helper=10 * len(sources)), len(sources),
                 {"wall_s": 1.0, "started_at": 100.0 + idx, "finished_at": 101.0 + idx}, 100, 0)


def write_run(root: Path, method: str, *, bench: str = "math500", n: int = 8, budget: int | None = 64, seed: int = 0,
              correct: set[int] = frozenset(), sources=lambda i: "bh", problems: int = 10, finished: bool = True,
              synthetic: bool = False, ent=lambda i: 1.0, evictor: str = "rkv", base: str | None = None,
              helper: str | None = None, prm: str | None = None, scorer: str = "prm",
              detector: dict | None = None, first: int = 0) -> Path:
    budget = budget if method in ("bon", "interleave", "kvrescue") else None
    roles = ROLES[method] if scorer == "prm" else {*ROLES[method], "helper"} - {"prm"}  # the helper scores
    models = {r: MODELS[r] for r in roles}
    models |= {role: ModelRef(model) for role, model in (("base", base), ("helper", helper), ("prm", prm))
               if model and role in roles}
    detector = (detector or {"tau_ent": 7.0, "tau_cmp": 0.18}) if method == "kvrescue" else None
    cfg = RunConfig(bench, method, budget, n, evictor if budget else "none", seed, models, scorer, synthetic,
                    {"temperature": 0.8, "detector": detector})
    path = run_dir(root, cfg)
    with RunFolder.open(path, cfg, total=problems) as rf:
        for i in range(first, first + (problems if finished else problems // 2)):
            rf.append(make_trace(i, i in correct, sources(i), ent(i)))
        if finished:
            rf.write_summary()
    return path


# bon B=64: incorrect problems with these step counts (>= 256 is degenerate)
BON64_S0 = {4: 300, 5: 300, 6: 300, 7: 256, 8: 2, 9: 2}   # 4 of 6 incorrect degenerate
BON64_S1 = {5: 256, 6: 2, 7: 2, 8: 255, 9: 2}             # 1 of 5


@pytest.fixture(scope="module")
def runs_root(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("runs")
    w = lambda *a, **k: write_run(root, *a, **k)  # noqa: E731
    w("full", seed=0, correct=set(range(8)))                       # 0.8
    w("full", seed=1, correct=set(range(7)))                       # 0.7
    w("bon", seed=0, correct=set(range(4)), sources=lambda i: "b" * BON64_S0.get(i, 2))    # 0.4
    w("bon", seed=1, correct=set(range(5)), sources=lambda i: "b" * BON64_S1.get(i, 2))    # 0.5
    w("kvrescue", seed=0, correct=set(range(7)), sources=lambda i: "bh", ent=lambda i: 0.5 * i)  # 0.7
    w("kvrescue", seed=1, correct=set(range(6)), sources=lambda i: "bhh")                  # 0.6
    w("bon", budget=128, correct=set(range(5)), sources=lambda i: "bbbb")                  # 0.5
    w("kvrescue", budget=128, correct=set(range(7)), sources=lambda i: "bbbh")             # 0.7
    w("kvrescue", n=2, correct=set(range(3)), sources=lambda i: "hhhh")                    # no bon at N=2
    w("interleave", correct={0, 1}, finished=False)              # in progress: 5 of 10 recorded, 0.4
    w("helper", correct=set(range(5)), sources=lambda i: "hh")
    # oracle: bon N=1 solves {0,1,2}, helper N=1 solves {2,3,4,5}, full N=1 0.8
    w("bon", n=1, correct={0, 1, 2}, sources=lambda i: "bb")
    w("helper", n=1, correct={2, 3, 4, 5}, sources=lambda i: "hh")
    w("full", n=1, correct=set(range(8)))
    # a second bench with no full run
    w("bon", bench="gsm8k", correct=set(range(8)))
    w("kvrescue", bench="gsm8k", correct=set(range(9)))
    return root


def report_json(*paths) -> dict:
    result = CliRunner().invoke(app, ["report", *map(str, paths), "--format", "json"])
    assert result.exit_code == 0, result.output
    return orjson.loads(result.stdout)


def table(data: dict, name: str) -> dict:
    return next(t for t in data["tables"] if t["name"] == name)


def rows_by(t: dict, *cols: str) -> dict:
    idx = [t["columns"].index(c) for c in cols]
    return {tuple(r[i] for i in idx): dict(zip(t["columns"], r)) for r in t["rows"]}


def population_std(*xs: float) -> float:
    """The paper's ± (Table 5): n, not n - 1, in the denominator."""
    m = sum(xs) / len(xs)
    return math.sqrt(sum((x - m) ** 2 for x in xs) / len(xs))


def test_accuracy_grid_mean_std_over_seeds(runs_root):
    t = table(report_json(runs_root), "accuracy")
    assert t["columns"] == ["method", "N", "budget", "gsm8k", "math500"]
    rows = rows_by(t, "method", "N", "budget")
    full = rows[("full", 8, None)]["math500"]
    assert full["mean"] == pytest.approx(0.75) and full["std"] == pytest.approx(population_std(0.8, 0.7))
    assert full["seeds"] == 2 and rows[("full", 8, None)]["gsm8k"] is None
    bon = rows[("bon", 8, 64)]["math500"]
    assert bon["mean"] == pytest.approx(0.45) and bon["std"] == pytest.approx(population_std(0.4, 0.5))
    kv = rows[("kvrescue", 8, 64)]
    assert kv["math500"]["mean"] == pytest.approx(0.65) and kv["gsm8k"]["mean"] == pytest.approx(0.9)
    assert kv["gsm8k"]["std"] is None and kv["gsm8k"]["seeds"] == 1
    assert rows[("interleave", 8, 64)]["math500"] == {"mean": 0.4, "std": None, "seeds": 1, "in_progress": True}
    assert rows[("helper", 8, None)]["math500"]["mean"] == pytest.approx(0.5)
    assert [r[0] for r in t["rows"]][:2] == ["full", "full"]      # references first


def test_recovery_per_setting_average_per_budget_and_na_reasons(runs_root):
    data = report_json(runs_root)
    rec = {(r["bench"], r["n"], r["budget"]): r for r in data["recovery"]}
    assert rec[("math500", 8, 64)]["recovery"] == pytest.approx((0.65 - 0.45) / (0.75 - 0.45))
    assert rec[("math500", 8, 128)]["recovery"] == pytest.approx((0.7 - 0.5) / (0.75 - 0.5))
    assert rec[("gsm8k", 8, 64)]["recovery"] is None
    assert rec[("gsm8k", 8, 64)]["reason"] == "no full run for gsm8k at N=8"
    assert rec[("math500", 2, 64)]["reason"] == "no bon or full run for math500 at N=2, B=64"
    t = table(data, "recovery")
    rows = rows_by(t, "N", "budget")
    assert rows[(8, 64)]["math500"] == pytest.approx(2 / 3) and rows[(8, 64)]["gsm8k"] is None
    assert rows[(8, 64)]["mean"] == pytest.approx(2 / 3)
    means = rows_by(table(data, "recovery_mean"), "evictor", "budget", "base")
    assert means[("rkv", 64, "all")]["recovery"] == pytest.approx(2 / 3)
    assert means[("rkv", 64, "all")]["settings"] == "1/3"     # gsm8k and N=2 have no recovery
    assert means[("rkv", 128, "all")]["recovery"] == pytest.approx(0.8)
    assert "n/a gsm8k, N=8, B=64: no full run for gsm8k at N=8" in t["notes"]


def test_recovery_when_full_equals_bon(tmp_path):
    write_run(tmp_path, "full", correct={0})
    write_run(tmp_path, "bon", correct={1})
    write_run(tmp_path, "kvrescue", correct={0, 1})
    (rec,) = report_json(tmp_path)["recovery"]
    assert rec["recovery"] is None
    assert rec["reason"] == "full and bon accuracies are equal (10.0%): no eviction loss to recover"


def test_a_synthetic_full_run_gives_no_recovery(tmp_path):
    write_run(tmp_path, "full", correct={0}, synthetic=True)
    write_run(tmp_path, "bon", correct={1})
    write_run(tmp_path, "kvrescue", correct={0, 1})
    (rec,) = report_json(tmp_path)["recovery"]
    assert (rec["recovery"], rec["reason"]) == (None, "synthetic run (no accuracy)")


def test_three_seeds_population_standard_deviation(tmp_path):
    for seed, correct in enumerate((2, 4, 9)):
        write_run(tmp_path, "bon", seed=seed, correct=set(range(correct)))
    data = report_json(tmp_path)
    (cell,) = [row[-1] for row in table(data, "accuracy")["rows"]]
    # 0.2, 0.4, 0.9: population std 0.2944 (the sample one, n - 1, would be 0.3606)
    assert cell == {"mean": pytest.approx(0.5), "std": pytest.approx(0.29439, abs=1e-5), "seeds": 3,
                    "in_progress": False}
    assert "population std" in table(data, "accuracy")["title"]


def test_recovery_pairs_the_bon_and_full_runs_of_the_same_evictor_and_base_model(tmp_path):
    w = lambda *a, **k: write_run(tmp_path, *a, **k)  # noqa: E731
    other = "Qwen/Qwen2.5-Math-1.5B-Instruct"
    w("full", correct=set(range(8)))                                    # 0.8
    w("full", base=other, correct=set(range(6)))                        # 0.6
    w("bon", correct=set(range(4)))                                     # 0.4 rkv
    w("bon", evictor="snapkv", correct=set(range(2)))                   # 0.2 snapkv
    w("bon", base=other, correct=set(range(1)))                         # 0.1 rkv, the other base
    w("kvrescue", correct=set(range(7)))                                # 0.7 rkv
    w("kvrescue", evictor="snapkv", correct=set(range(5)))              # 0.5 snapkv
    w("kvrescue", base=other, correct=set(range(3)), finished=False)    # 3 of 5 recorded: 0.6, in progress
    w("kvrescue", evictor="streaming", correct=set(range(5)))           # no streaming bon
    rec = {(r["evictor"], r["base"]): r for r in report_json(tmp_path)["recovery"]}
    base = MODELS["base"].id
    assert rec[("rkv", base)] == {"bench": "math500", "n": 8, "budget": 64, "evictor": "rkv", "base": base,
                                  "recovery": pytest.approx((0.7 - 0.4) / (0.8 - 0.4)), "reason": None,
                                  "in_progress": False}
    assert rec[("snapkv", base)]["recovery"] == pytest.approx((0.5 - 0.2) / (0.8 - 0.2))
    assert rec[("rkv", other)]["recovery"] == pytest.approx((0.6 - 0.1) / (0.6 - 0.1))
    assert rec[("rkv", other)]["in_progress"] and not rec[("snapkv", base)]["in_progress"]
    assert rec[("streaming", base)]["recovery"] is None
    assert rec[("streaming", base)]["reason"] == "no bon run for math500 at N=8, B=64"


def test_a_duplicate_run_folder_is_left_out_with_a_note(tmp_path):
    import shutil

    first = write_run(tmp_path / "a", "bon", correct=set(range(4)))
    copy = tmp_path / "b" / first.relative_to(tmp_path / "a")
    shutil.copytree(first, copy)
    other = tmp_path / "c" / first.relative_to(tmp_path / "a")  # the same row and seed, another temperature
    shutil.copytree(first, other)
    config = orjson.loads((other / "config.json").read_bytes())
    config["config"]["settings"]["temperature"] = 0.6
    (other / "config.json").write_bytes(orjson.dumps(config))
    runs, problems = load_runs([tmp_path])
    assert [r.path for r in runs] == [first] and runs[0].summary.accuracy == pytest.approx(0.4)
    notes = {p.path: p.message for p in problems}
    assert notes[str(copy)] == f"a copy of {first}; left out"
    assert notes[str(other)] == f"same bench, method, N, budget and seed as {first} with other settings; left out"
    data = report_json(tmp_path / "a", tmp_path / "b")
    assert table(data, "accuracy")["rows"][0][-1]["seeds"] == 1


def test_decode_cost_and_ablation(runs_root):
    data = report_json(runs_root)
    cost = rows_by(table(data, "cost"), "bench", "method", "N", "budget")
    # bon B=64 mean steps: seed 0 (4*2 + 300*3 + 256 + 2*2) / 10, seed 1 (5*2 + 256 + 2 + 2 + 255 + 2) / 10
    s0, s1 = (8 + 900 + 256 + 4) / 10, (10 + 256 + 2 + 2 + 255 + 2) / 10
    bon = cost[("math500", "bon", 8, 64)]
    assert bon["steps"]["mean"] == pytest.approx((s0 + s1) / 2)
    assert bon["base tokens"]["mean"] == pytest.approx(20 * (s0 + s1) / 2)     # 2 base candidates x 10 tokens
    assert bon["output tokens"]["mean"] == pytest.approx(10 * (s0 + s1) / 2)
    kv = cost[("math500", "kvrescue", 8, 64)]
    assert kv["steps"]["mean"] == pytest.approx(2.5) and kv["helper tokens"]["mean"] == pytest.approx(25)
    assert kv["Δ base tokens vs bon"] == pytest.approx((50 - 20 * (s0 + s1) / 2) / (20 * (s0 + s1) / 2))
    assert cost[("math500", "kvrescue", 8, 128)]["Δ base tokens vs bon"] == pytest.approx(0.0)
    assert cost[("math500", "full", 8, None)]["base tokens"]["mean"] == pytest.approx(40)    # Table 1's full-KV row
    abl = rows_by(table(data, "ablation"), "bench", "method", "N", "budget")
    # Table 2's numbers count over all 10 problems (4 and 1 degenerate); its caption's reading, over the incorrect
    assert abl[("math500", "bon", 8, 64)]["degeneration"]["mean"] == pytest.approx((4 / 10 + 1 / 10) / 2)
    assert abl[("math500", "bon", 8, 64)]["degeneration of incorrect"]["mean"] == pytest.approx((4 / 6 + 1 / 5) / 2)
    assert abl[("math500", "kvrescue", 8, 64)]["degeneration"]["mean"] == pytest.approx(0.0)
    assert abl[("math500", "full", 8, None)]["accuracy"]["mean"] == pytest.approx(0.75)       # Table 2's full-KV row
    # early exit: 1 of the 2 base candidates of each problem's first step when it is a base step
    assert abl[("math500", "kvrescue", 8, 64)]["early exit"]["mean"] == pytest.approx(((10 / 40) + 10 / 60) / 2)
    assert abl[("math500", "bon", 8, 128)]["early exit"]["mean"] == pytest.approx(1 / 8)
    assert abl[("math500", "interleave", 8, 64)]["accuracy"]["in_progress"] is True


def test_helper_share_by_budget_and_n(runs_root):
    t = table(report_json(runs_root), "helper_share")
    assert t["columns"] == ["bench", "method", "budget", "N=2", "N=8"]
    rows = rows_by(t, "bench", "method", "budget")
    assert rows[("math500", "kvrescue", 64)]["N=8"]["mean"] == pytest.approx((1 / 2 + 2 / 3) / 2)
    assert rows[("math500", "kvrescue", 64)]["N=8"]["std"] == pytest.approx(population_std(1 / 2, 2 / 3))
    assert rows[("math500", "kvrescue", 64)]["N=2"]["mean"] == pytest.approx(1.0)
    assert rows[("math500", "kvrescue", 128)]["N=8"]["mean"] == pytest.approx(0.25)
    assert rows[("math500", "kvrescue", 128)]["N=2"] is None


def test_oracle_of_two(runs_root):
    data = report_json(runs_root)
    (o,) = data["oracle"]
    assert (o["bon"], o["helper_acc"], o["oracle"], o["full"]) == pytest.approx((0.3, 0.4, 0.6, 0.8))
    assert o["recovered"] == pytest.approx((0.6 - 0.3) / (0.8 - 0.3)) and o["seeds"] == 1
    (row,) = table(data, "oracle")["rows"]
    assert row[:3] == ["math500", 64, 1]


def test_detector_calibration_quantiles(runs_root):
    t = table(report_json(runs_root), "calibration")
    rows = rows_by(t, "bench", "method", "N", "budget", "statistic", "committed")
    qcols = [f"q{round(100 * q)}" for q in QUANTILES]
    committed = rows[("math500", "kvrescue", 8, 64, "max_mean_entropy", "yes")]
    # seed 0: problems i commit one base step each with entropy 0.5 i; seed 1: entropy 1.0 (one base step each)
    values = [0.5 * i for i in range(10)] + [1.0] * 10
    assert committed["count"] == 20
    assert [committed[c] for c in qcols] == pytest.approx(list(np.quantile(values, QUANTILES)))
    others = rows[("math500", "kvrescue", 8, 64, "max_mean_entropy", "no")]
    # seed 0 ("bh"): the second base candidate of both steps (0.5 i + 5) and the base one of the helper
    # step (0.5 i); seed 1 ("bhh"): three second candidates (6.0) and two base ones of helper steps (1.0)
    other_values = [v for i in range(10) for v in (0.5 * i + 5, 0.5 * i, 0.5 * i + 5)] + [6.0, 1.0, 6.0, 1.0, 6.0] * 10
    assert others["count"] == 80 and others["threshold"] == 7.0
    assert others["beyond"] == pytest.approx(sum(v > 7.0 for v in other_values) / 80)
    assert [others[c] for c in qcols] == pytest.approx(list(np.quantile(other_values, QUANTILES)))
    gz = rows[("math500", "kvrescue", 8, 64, "min_gzip_ratio", "no")]
    assert gz["threshold"] == 0.18 and gz["beyond"] == 0.0 and gz["q50"] == pytest.approx(0.4)


def test_markdown_csv_and_table_formats(runs_root):
    runner = CliRunner()
    md = runner.invoke(app, ["report", str(runs_root), "--format", "md"])
    assert md.exit_code == 0
    assert "| method | N | budget | gsm8k (%) | math500 (%) |" in md.stdout
    assert "| full | 8 | — | n/a | 75.0 ± 5.0 |" in md.stdout
    assert "| interleave | 8 | 64 | n/a | 40.0* |" in md.stdout
    for block in md.stdout.split("### ")[1:]:
        lines = [l for l in block.splitlines() if l.startswith("|") and "\\|" not in l]
        assert len({l.count("|") for l in lines}) == 1      # rectangular
    rich = runner.invoke(app, ["report", str(runs_root)], env={"COLUMNS": "250"})
    assert rich.exit_code == 0 and rich.stderr == ""  # the product on stdout (`kvrescue report runs > report.txt`)
    assert "Recovery" in rich.stdout and "math500 (%)" in rich.stdout
    assert "* no summary.json: running or interrupted" in rich.stdout


def test_csv_is_one_tidy_long_table_in_percent(runs_root):
    import pandas as pd

    out = CliRunner().invoke(app, ["report", str(runs_root), "--format", "csv"])
    assert out.exit_code == 0
    frame = pd.read_csv(io.StringIO(out.stdout))
    assert {"table", "row", "bench", "method", "N", "budget", "metric", "value", "std", "seeds", "unit"} <= set(frame)
    assert {"runs", "accuracy", "recovery", "recovery_mean", "cost", "token_change", "ablation", "helper_share",
            "oracle", "calibration", "throughput"} <= set(frame["table"])
    full = frame[(frame.table == "accuracy") & (frame.method == "full") & (frame.N == 8) & (frame.metric == "math500")]
    assert len(full) == 1 and full.value.item() == pytest.approx(75.0) and full["std"].item() == pytest.approx(5.0)
    assert full.seeds.item() == 2 and full.unit.item() == "%"
    mean = frame[(frame.table == "recovery_mean") & (frame.budget == 64) & (frame.metric == "recovery")]
    assert mean.value.item() == pytest.approx(100 * 2 / 3, abs=1e-3)
    steps = frame[(frame.table == "cost") & (frame.metric == "steps")]
    assert steps.unit.isna().all()                            # counts have no unit; percentages say "%"


def test_latex_is_booktabs_with_units_in_the_headers(runs_root):
    out = CliRunner().invoke(app, ["report", str(runs_root), "--format", "latex"])
    assert out.exit_code == 0
    assert out.stdout.count("\\begin{tabular}") == out.stdout.count("\\bottomrule") >= 10
    assert "method & N & budget & gsm8k (\\%) & math500 (\\%) \\\\" in out.stdout
    assert "full & 8 & --- & n/a & 75.0 $\\pm$ 5.0 \\\\" in out.stdout
    assert "\\toprule" in out.stdout and "\\midrule" in out.stdout


def test_plot_draws_the_accuracies(runs_root, tmp_path, monkeypatch):
    import matplotlib.pyplot as plt

    drawn = []
    monkeypatch.setattr(plt, "close", drawn.append)  # keep the figure to read what was plotted
    png = tmp_path / "fig" / "pareto.png"
    result = CliRunner().invoke(app, ["report", str(runs_root), "--plot", str(png)])
    assert result.exit_code == 0, result.output
    head = png.read_bytes()[:24]
    assert head[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", head[16:24])
    assert 800 <= width <= 2000 and 300 <= height <= 800      # two benches side by side
    (fig,) = drawn
    plotted = {}
    for ax in fig.axes:
        curves = {c.get_label(): [(x, pytest.approx(y)) for x, y in zip(*c.lines[0].get_data())] for c in ax.containers}
        levels = {line.get_label(): pytest.approx(line.get_ydata()[0]) for line in ax.get_lines()
                  if not line.get_label().startswith("_")}
        plotted[ax.get_title()] = {**curves, **levels}
    assert plotted == {
        "gsm8k": {"bon N=8": [(64, 80.0)], "kvrescue N=8": [(64, 90.0)]},
        "math500": {"full N=1": 80.0, "full N=8": 75.0, "helper N=1": 40.0, "helper N=8": 50.0,
                    "bon N=1": [(64, 30.0)], "bon N=8": [(64, 45.0), (128, 50.0)], "interleave N=8 *": [(64, 40.0)],
                    "kvrescue N=2": [(64, 30.0)], "kvrescue N=8": [(64, 65.0), (128, 70.0)]},
    }
    bars = {c.get_label(): c.lines[2][0].get_segments() for c in fig.axes[1].containers}
    (low, high), _ = [(seg[0][1], seg[1][1]) for seg in bars["bon N=8"]]  # seed std at B=64, one seed at B=128
    assert (high - low) / 2 == pytest.approx(100 * population_std(0.4, 0.5))


def test_subprocess_cli_json(runs_root):
    proc = subprocess.run([str(VENV_KVRESCUE), "report", str(runs_root / "math500"), "--format", "json"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    data = orjson.loads(proc.stdout)
    assert {r["bench"] for r in data["recovery"]} == {"math500"}


def test_bad_inputs(tmp_path, runs_root):
    runner = CliRunner()
    (tmp_path / "empty").mkdir()
    r = runner.invoke(app, ["report", str(tmp_path / "empty")])
    assert r.exit_code == 2 and "no run folders here" in r.stderr and "Traceback" not in r.output
    assert r.stderr.count("\n") == 1
    r = runner.invoke(app, ["report", str(tmp_path / "missing")])
    assert r.exit_code == 2 and "no such file or folder" in r.stderr
    r = runner.invoke(app, ["report", str(runs_root), "--format", "xml"])
    assert r.exit_code == 2 and "unknown --format 'xml'" in r.stderr
    # a corrupt traces line in one folder: that folder is reported, the rest still reported
    bad = write_run(tmp_path / "runs", "kvrescue", bench="aime24")
    good = write_run(tmp_path / "runs", "bon", bench="aime24", correct={0})
    lines = (bad / "traces.jsonl").read_bytes().split(b"\n")
    lines[1] = b'{"idx": 1, "problem": "p1", "ste'
    (bad / "traces.jsonl").write_bytes(b"\n".join(lines))
    data = report_json(tmp_path / "runs")
    assert any(p["path"] == str(bad) and "traces.jsonl:2: corrupt traces line" in p["message"]
               for p in data["problems"])
    assert [row[0] for row in table(data, "runs")["rows"]] == [str(good)]
    # a config.json that is not JSON, and traces without a config
    (tmp_path / "x" / "a").mkdir(parents=True)
    (tmp_path / "x" / "a" / "config.json").write_text("{")
    (tmp_path / "x" / "b").mkdir()
    (tmp_path / "x" / "b" / "traces.jsonl").write_text("")
    r = runner.invoke(app, ["report", str(tmp_path / "x")])
    assert r.exit_code == 2 and "no usable run folders" in r.stderr and "not valid JSON" in r.stderr
    assert "config.json: missing" in r.stderr


def test_torn_line_and_missing_summary_are_noted_not_fatal(tmp_path):
    path = write_run(tmp_path, "bon", correct={0, 1})
    (path / "traces.jsonl").write_bytes((path / "traces.jsonl").read_bytes() + b'{"idx": 10, "pro')
    (path / "summary.json").unlink()
    before = (path / "traces.jsonl").read_bytes()
    runs, problems = load_runs([tmp_path])
    assert runs[0].summary.problems == 10 and runs[0].in_progress.startswith("no summary.json")
    messages = [p.message for p in problems]
    assert any("dropped a torn last line" in m for m in messages)
    assert (path / "traces.jsonl").read_bytes() == before       # the report never modifies a run


@pytest.mark.parametrize("command", [["report", "--format", "json"], ["report", "--explain"], ["view", "-o", "p.html"]])
def test_a_folder_with_a_null_threshold_is_listed_as_unusable_and_the_others_shown(tmp_path, command):
    write_run(tmp_path / "runs", "bon")
    bad = write_run(tmp_path / "runs", "kvrescue", detector={"tau_ent": None, "tau_cmp": 0.18})  # --tau-ent nan, once
    done = kvrescue(*command[:1], str(tmp_path / "runs"), *command[1:], cwd=tmp_path)
    assert done.returncode == 0 and b"Traceback" not in done.stderr, done.stderr.decode()[-2000:]
    said = (done.stdout + done.stderr).decode()
    assert f"{bad.name}" in said and "settings.detector" in said
    if command[0] == "report":
        assert "bon" in said


def test_synthetic_runs_report_no_accuracy(tmp_path):
    write_run(tmp_path, "full", correct={0}, synthetic=True)
    write_run(tmp_path, "bon", correct={0}, synthetic=True)
    write_run(tmp_path, "kvrescue", correct={0}, synthetic=True)
    data = report_json(tmp_path)
    assert data["recovery"][0]["reason"] == "synthetic run (no accuracy)"
    assert all(row[-1] == {"mean": None, "std": None, "seeds": 0, "in_progress": False}
               for row in table(data, "accuracy")["rows"])
    r = CliRunner().invoke(app, ["report", str(tmp_path), "--plot", str(tmp_path / "p.png")])
    assert r.exit_code == 2 and "nothing to plot" in r.stderr


def test_quantiles_match_numpy_for_every_size():
    rng = np.random.default_rng(0)
    for size in range(1, 7):
        values = list(rng.normal(size=size))
        assert quantiles(values) == pytest.approx(list(np.quantile(values, QUANTILES)))
    assert quantiles([]) == [None] * len(QUANTILES)


def test_rows_come_in_one_order_whatever_order_the_runs_are_found_in(tmp_path):
    # Setups by scorer then PRM id; rows by bench, method (references first), evictor, N, budget, base, helper.
    other_base, other_helper, other_prm = "Qwen/Other-Base", "Qwen/Other-Helper", "Qwen/Other-PRM"
    w = lambda *a, **k: write_run(tmp_path, *a, **k)  # noqa: E731
    for budget in (256, 64, 128):
        w("kvrescue", budget=budget)
    w("kvrescue", base=other_base)
    w("kvrescue", helper=other_helper)
    w("kvrescue", evictor="snapkv")
    w("kvrescue", n=2)
    for method in ("bon", "helper", "full", "interleave"):
        w(method)
    w("bon", bench="gsm8k")
    w("bon", prm=other_prm)
    w("bon", scorer="helper-loglik")
    runs, _ = load_runs([tmp_path])
    base = MODELS["base"].id
    helper = MODELS["helper"].id
    expected = {
        ("helper-loglik", None): [("math500", "bon", "rkv", 8, 64, base, None)],
        ("prm", other_prm): [("math500", "bon", "rkv", 8, 64, base, None)],
        ("prm", MODELS["prm"].id): [
            ("gsm8k", "bon", "rkv", 8, 64, base, None), ("math500", "full", "none", 8, None, base, None),
            ("math500", "helper", "none", 8, None, None, helper), ("math500", "bon", "rkv", 8, 64, base, None),
            ("math500", "interleave", "rkv", 8, 64, base, helper), ("math500", "kvrescue", "rkv", 2, 64, base, helper),
            ("math500", "kvrescue", "rkv", 8, 64, other_base, helper),
            ("math500", "kvrescue", "rkv", 8, 64, base, other_helper), ("math500", "kvrescue", "rkv", 8, 64, base, helper),
            ("math500", "kvrescue", "rkv", 8, 128, base, helper), ("math500", "kvrescue", "rkv", 8, 256, base, helper),
            ("math500", "kvrescue", "snapkv", 8, 64, base, helper)],
    }
    for order in (runs, runs[::-1]):
        grouped = group_rows(order)
        assert list(grouped) == list(expected)
        assert {setup: [(r.key.bench, r.key.method, r.key.evictor, r.key.n, r.key.budget, r.key.base, r.key.helper)
                        for r in rows]
                for setup, rows in grouped.items()} == expected


def test_an_unfinished_synthetic_run_shows_in_progress_without_accuracy(tmp_path):
    write_run(tmp_path, "bon", synthetic=True, finished=False)
    (row,) = table(report_json(tmp_path), "accuracy")["rows"]
    assert row[-1] == {"mean": None, "std": None, "seeds": 0, "in_progress": True}


@pytest.mark.parametrize("synthetic", ["kvrescue", "bon"])
def test_recovery_needs_an_accuracy_from_each_of_the_three_runs(tmp_path, synthetic):
    for method, correct in (("full", {0, 1, 2}), ("bon", {0}), ("kvrescue", {0, 1})):
        write_run(tmp_path, method, correct=correct, synthetic=method == synthetic)
    (rec,) = report_json(tmp_path)["recovery"]
    assert (rec["recovery"], rec["reason"]) == (None, "synthetic run (no accuracy)")


def oracle_record(**values) -> dict:
    """An oracle record for math500 B=64 rkv with the default models; `values` override the n/a defaults."""
    return {"bench": "math500", "budget": 64, "evictor": "rkv", "base": MODELS["base"].id,
            "helper": MODELS["helper"].id, "seeds": 0, "bon": None, "helper_acc": None, "oracle": None, "full": None,
            "recovered": None, "reason": None, "in_progress": False} | values


def test_oracle_averages_the_seeds_that_pair_up(tmp_path):
    # seed 0: bon {0,1,2}, helper {2,3,4,5}: oracle 0.6; seed 1: bon {0}, helper {1,2}: oracle 0.3.
    for seed, bon, helper in ((0, {0, 1, 2}, {2, 3, 4, 5}), (1, {0}, {1, 2})):
        write_run(tmp_path, "bon", n=1, seed=seed, correct=bon)
        write_run(tmp_path, "helper", n=1, seed=seed, correct=helper)
    write_run(tmp_path, "full", n=1, correct=set(range(8)))
    (rec,) = report_json(tmp_path)["oracle"]
    assert rec == oracle_record(seeds=2, bon=pytest.approx(0.2), helper_acc=pytest.approx(0.3),
                                oracle=pytest.approx(0.45), full=0.8, recovered=pytest.approx((0.45 - 0.2) / (0.8 - 0.2)))


def test_oracle_counts_the_problems_both_runs_recorded_and_says_when_nothing_is_recoverable(tmp_path):
    # The helper run is in progress with problems 0-4 recorded (3 and 4 correct); bon solved {0, 1, 2} of 10.
    # Over the 5 common problems: bon 0.6, helper 0.4, oracle 1.0; full N=1 is 0.6 as well: nothing to recover.
    write_run(tmp_path, "bon", n=1, correct={0, 1, 2})
    write_run(tmp_path, "helper", n=1, correct={3, 4, 7}, finished=False)
    write_run(tmp_path, "full", n=1, correct=set(range(6)))
    (rec,) = report_json(tmp_path)["oracle"]
    assert rec == oracle_record(seeds=1, bon=pytest.approx(0.6), helper_acc=pytest.approx(0.4), oracle=1.0, full=0.6,
                                reason="full and bon accuracies are equal (60.0%): no eviction loss to recover",
                                in_progress=True)


def test_oracle_without_a_common_seed_or_a_full_run(tmp_path):
    write_run(tmp_path, "bon", n=1, seed=0, correct={0})
    write_run(tmp_path / "one", "helper", n=1, seed=1, correct={1})
    (rec,) = report_json(tmp_path)["oracle"]
    assert rec == oracle_record(reason="no bon and helper runs with the same seed")
    write_run(tmp_path / "two", "helper", n=1, seed=0, correct={1})
    (rec,) = report_json(tmp_path / "two", tmp_path / "math500")["oracle"]
    assert rec == oracle_record(seeds=1, bon=0.1, helper_acc=0.1, oracle=0.2, reason="no full run for math500 at N=1")


def test_calibration_uses_each_runs_own_thresholds(tmp_path):
    write_run(tmp_path, "kvrescue", ent=lambda i: 0.5 * i, detector={"tau_ent": 3.0, "tau_cmp": 0.45})
    t = table(report_json(tmp_path), "calibration")
    rows = rows_by(t, "statistic", "committed")
    # committed base candidates: max mean entropy 0.5 i for problem i, so 3 of 10 are above 3.0 (3.5, 4.0, 4.5)
    assert rows[("max_mean_entropy", "yes")]["threshold"] == 3.0
    assert rows[("max_mean_entropy", "yes")]["beyond"] == pytest.approx(0.3)
    # min gzip ratio: 0.5 for the committed ones; 0.4, 0.5, 0.4 for the others of each problem: 0.4 is under 0.45
    assert rows[("min_gzip_ratio", "yes")]["threshold"] == 0.45 and rows[("min_gzip_ratio", "yes")]["beyond"] == 0.0
    assert rows[("min_gzip_ratio", "no")]["beyond"] == pytest.approx(2 / 3)


@pytest.mark.parametrize("unpaired, reason", [
    ({"first": 10, "correct": {10}}, "the paired bon and helper runs share no problems"),
    ({"seed": 1, "correct": {1}}, "no bon and helper runs with the same seed"),
])
def test_oracle_goes_on_past_a_helper_run_it_cannot_pair(tmp_path, unpaired, reason):
    # Two helper N=1 runs (two helper models): the first ran problems 10-19 (none of bon's 0-9) or another seed,
    # the second pairs up with bon.
    write_run(tmp_path, "bon", n=1, correct={0, 1, 2})
    write_run(tmp_path, "helper", n=1, **unpaired)
    write_run(tmp_path, "helper", n=1, helper="Zz/Other-Helper", correct={2, 3})
    write_run(tmp_path, "full", n=1, correct=set(range(8)))
    first, second = report_json(tmp_path)["oracle"]
    assert first == oracle_record(reason=reason)
    assert second == oracle_record(helper="Zz/Other-Helper", seeds=1, bon=0.3, helper_acc=0.2, oracle=pytest.approx(0.4),
                                   full=0.8, recovered=pytest.approx((0.4 - 0.3) / (0.8 - 0.3)))


def test_accuracy_axes_stay_within_0_and_100_percent(tmp_path, monkeypatch):
    import matplotlib.pyplot as plt

    from kvrescue.report.render import accuracy_limits

    assert accuracy_limits(-0.04, 0.04) == (0.0, 10.0)  # every accuracy 0: matplotlib's default is -0.04..0.04
    assert accuracy_limits(96.0, 104.0) == (90.0, 100.0)
    assert accuracy_limits(20.0, 80.0) == (20.0, 80.0)
    assert accuracy_limits(44.0, 46.0) == (40.0, 50.0)
    for acc in (set(), set(range(10))):  # every problem wrong, every problem right
        root = tmp_path / str(len(acc))
        for method in ("bon", "kvrescue", "full"):
            write_run(root, method, correct=acc)
        drawn = []
        monkeypatch.setattr(plt, "close", drawn.append)
        assert CliRunner().invoke(app, ["report", str(root), "--plot", str(root / "plot.png")]).exit_code == 0
        (fig,) = drawn
        low, high = fig.axes[0].get_ylim()
        assert 0.0 <= low < high <= 100.0 and high - low >= 10.0


def test_accuracy_is_table_5s_boxed_and_correct_and_recovery_uses_it(tmp_path):
    """bon's correct answers carry no \\boxed (the grader read "the answer is"): Table 5 counts none of them."""
    write_run(tmp_path, "full", correct=set(range(8)))
    bon = write_run(tmp_path, "bon", correct=set(range(6)))
    write_run(tmp_path, "kvrescue", correct=set(range(7)))
    lines = (bon / "traces.jsonl").read_bytes().splitlines()
    unboxed = [orjson.loads(line) | ({"output": "The answer is 1"} if i < 4 else {}) for i, line in enumerate(lines)]
    (bon / "traces.jsonl").write_bytes(b"".join(orjson.dumps(t) + b"\n" for t in unboxed))
    data = report_json(tmp_path)
    paper = {k[0]: v for k, v in rows_by(table(data, "accuracy"), "method").items()}
    grader = {k[0]: v for k, v in rows_by(table(data, "accuracy_grader"), "method").items()}
    assert paper["bon"]["math500"]["mean"] == pytest.approx(0.2) and grader["bon"]["math500"]["mean"] == pytest.approx(0.6)
    assert "is_correct ∧ \\boxed (Table 5)" in table(data, "accuracy")["title"]
    (rec,) = data["recovery"]
    assert rec["recovery"] == pytest.approx((0.7 - 0.2) / (0.8 - 0.2))      # the grader's would give 0.5


def test_throughput_is_problems_per_minute_after_the_first_finished_with_ratios(tmp_path):
    write_run(tmp_path, "full", problems=10)        # make_trace: problem i runs [100 + i, 101 + i]
    write_run(tmp_path, "bon", problems=4)
    write_run(tmp_path, "kvrescue", problems=7)
    rows = {k[0]: v for k, v in rows_by(table(report_json(tmp_path), "throughput"), "method").items()}
    # after the first finish at 101: 9, 3 and 6 problems in 9, 3 and 6 s
    assert rows["full"]["problems/min"]["mean"] == pytest.approx(60.0)
    assert rows["kvrescue"]["× full"] == pytest.approx(1.0) and rows["kvrescue"]["× bon"] == pytest.approx(1.0)
    assert rows["full"]["× full"] is None and rows["bon"]["× bon"] is None


def test_json_names_the_unit_of_every_column(runs_root):
    t = table(report_json(runs_root), "accuracy")
    assert t["units"] == [None, None, None, "fraction", "fraction"]
    assert table(report_json(runs_root), "cost")["units"][-1] == "relative change, fraction"


def voted(trace: Trace, voters: list[tuple[str, float, bool]]) -> Trace:
    """`trace` whose last step's candidates are these voters (pred, score, correct), the first one committed."""
    trace.candidates[-1] = [Candidate("base", score, 10, "eos", committed=i == 0, text=None if i == 0 else "t",
                                      pred=pred, correct=correct)
                            for i, (pred, score, correct) in enumerate(voters)]
    trace.candidates[-1].append(Candidate("helper", 0.99, 10, "step", text="t"))  # no solution: no vote
    return trace


def test_the_prm_weighted_vote_sums_each_answers_scores_as_search_and_learn_does(tmp_path):
    from kvrescue.outputs.summary import summarize, vote
    from kvrescue.report.tables import build_tables, vote_table

    wrong_committed = voted(make_trace(0, False, "bh"), [("5", 0.5, False), ("4", 0.3, True), ("4", 0.3, True)])
    assert vote(wrong_committed, "prm") is True  # 0.6 for "4" beats 0.5 for "5"; the 0.99 step is no solution
    tie = voted(make_trace(1, True, "bh"), [("1", 0.5, True), ("2", 0.25, False), ("2", 0.25, False)])
    assert vote(tie, "prm") is True  # equal sums: the first group, in candidate order
    logliks = [("5", -0.3, False), ("4", -0.5, True), ("4", -0.5, True)]
    assert vote(voted(make_trace(2, False, "bh"), logliks), "helper-loglik") is True  # exp: 1.21 for "4" vs 0.74
    assert vote(voted(make_trace(2, False, "bh"), logliks), "prm") is False  # as plain sums: -0.3 beats -1.0
    assert vote(make_trace(3, True, "bh"), "prm") is None  # a trace from before voters were recorded

    cfg = RunConfig("math500", "bon", 64, 8, "rkv", 0, {"base": MODELS["base"], "prm": MODELS["prm"]}, "prm", False,
                    {"temperature": 0.8, "detector": None})
    summary = summarize([wrong_committed, tie], cfg)
    assert (summary.accuracy, summary.vote_correct, summary.vote_accuracy) == (0.5, 2, 1.0)
    assert summarize([wrong_committed, make_trace(3, True, "bh")], cfg).vote_accuracy is None
    path = run_dir(tmp_path, cfg)
    with RunFolder.open(path, cfg, total=2) as rf:
        for t in (wrong_committed, tie):
            rf.append(t)
        rf.write_summary()
    (table,) = [t for t in build_tables(*load_runs([tmp_path])) if t.name == "vote"]
    assert [[cell.mean if hasattr(cell, "mean") else cell for cell in row] for row in table.rows] == [
        ["math500", "bon", 8, 64, 0.5, 1.0]]
    assert vote_table([], "x").rows == []
