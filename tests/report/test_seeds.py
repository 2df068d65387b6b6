"""Metrics over seeds (avg@n, pass@k, maj@k): the estimators against brute force and hand-computed tables,
through every report format and the view's report."""

import math
from itertools import combinations
from pathlib import Path

import orjson
import pytest
from typer.testing import CliRunner

from kvrescue.cli import app
from kvrescue.outputs import Candidate, ModelRef, RunConfig, RunFolder, Step, Tokens, Trace, run_dir
from kvrescue.report import load_runs
from kvrescue.report.seeds import maj_at_k, majority_correct, pass_at_k
from kvrescue.view.data import page_data


def test_pass_at_k_equals_the_share_of_k_subsets_holding_a_correct_sample():
    for n in range(1, 7):
        for c in range(n + 1):
            samples = [True] * c + [False] * (n - c)
            for k in range(1, n + 1):
                subsets = list(combinations(samples, k))
                brute = sum(any(s) for s in subsets) / len(subsets)
                assert pass_at_k(n, c, k) == pytest.approx(brute, abs=1e-12), (n, c, k)


def test_pass_at_k_refuses_k_outside_one_to_n():
    for n, c, k in ((3, 1, 0), (3, 1, 4), (3, 4, 1)):
        with pytest.raises(ValueError):
            pass_at_k(n, c, k)


def test_majority_ties_go_to_the_answer_first_voted_for():
    assert majority_correct([("2", False), ("1", True)]) is False
    assert majority_correct([("1", True), ("2", False)]) is True
    assert majority_correct([("2", False), ("1", True), ("1", True)]) is True
    assert majority_correct([("3", False), ("1", True), ("2", False), ("1", True), ("2", False)]) is True


def test_maj_at_k_averages_every_choice_of_k_votes():
    votes = [("1", True), ("0", False), ("0", False)]
    assert maj_at_k(votes, 1) == pytest.approx(1 / 3)
    assert maj_at_k(votes, 2) == pytest.approx(2 / 3)  # {0,1} and {0,2} tie: seed 0's "1" wins; {1,2}: "0"
    assert maj_at_k(votes, 3) == 0.0


# Four problems over three seeds: (pred, correct) per seed; the answer is "1".
VOTES = {0: [("1", True), ("1", True), ("1", True)],
         1: [("1", True), ("0", False), ("0", False)],
         2: [("0", False), ("5", False), ("1", True)],
         3: [("0", False), ("0", False), ("0", False)]}
# By hand (see the module docstring of kvrescue.report.seeds for the rules):
SEED_ACCURACY = [2 / 4, 1 / 4, 2 / 4]
EXPECTED = {"pass@1": 5 / 12, "pass@2": 7 / 12, "pass@3": 3 / 4,
            "maj@1": 5 / 12, "maj@2": 5 / 12, "maj@3": 1 / 4}


def _trace(idx: int, pred: str, correct: bool) -> Trace:
    committed = Candidate("base", 0.9, 10, "step", 1.0, 0.5, None, True)
    return Trace(idx, f"p{idx}", "1", "1", [Step("s\n\n", "base", 0.9, 10)], [[committed]], "", pred, correct, False,
                 "eos", None, Tokens(base=10), 1, {"wall_s": 1.0, "started_at": 100.0, "finished_at": 101.0}, 20, 0)


def _write_seeds(root: Path, votes: dict[int, list[tuple[str, bool]]], seeds: int | list[int]) -> None:
    """One finished bon run per seed (0 to `seeds` - 1, or those listed); problem i only in the seeds that `votes[i]`
    has a vote of (its k-th vote is the k-th seed's)."""
    models = {"base": ModelRef("Qwen/Qwen2.5-Math-7B-Instruct"), "prm": ModelRef("Qwen/Qwen2.5-Math-PRM-7B")}
    for k, seed in enumerate(range(seeds) if isinstance(seeds, int) else seeds):
        cfg = RunConfig("math500", "bon", 64, 8, "rkv", seed, models, "prm", False, {"temperature": 0.8})
        mine = {idx: per_seed[k] for idx, per_seed in votes.items() if k < len(per_seed)}
        with RunFolder.open(run_dir(root, cfg), cfg, total=len(mine)) as rf:
            for idx, vote in mine.items():
                rf.append(_trace(idx, *vote))
            rf.write_summary()


@pytest.fixture(scope="module")
def seeds_root(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("seeds")
    _write_seeds(root, VOTES, 3)
    return root


def _seeds_table(tables: list[dict]) -> dict:
    (table,) = [t for t in tables if t["name"] == "seeds"]
    return table


def test_report_json_gives_avg_pass_and_maj_by_hand(seeds_root):
    done = CliRunner().invoke(app, ["report", str(seeds_root), "--format", "json", "--k", "1,2,3,8"])
    assert done.exit_code == 0, done.output
    table = _seeds_table(orjson.loads(done.stdout)["tables"])
    assert table["columns"] == ["bench", "method", "N", "budget", "seeds", "problems", "avg@n",
                                "pass@1", "pass@2", "pass@3", "maj@1", "maj@2", "maj@3"]  # k = 8 > 3 seeds: left out
    (row,) = table["rows"]
    cells = dict(zip(table["columns"], row))
    assert cells["bench"] == "math500" and cells["method"] == "bon" and cells["seeds"] == 3 and cells["problems"] == 4
    mean = sum(SEED_ACCURACY) / 3
    std = math.sqrt(sum((a - mean) ** 2 for a in SEED_ACCURACY) / 3)  # population std, as the paper
    assert cells["avg@n"]["mean"] == pytest.approx(mean) and cells["avg@n"]["std"] == pytest.approx(std)
    for name, value in EXPECTED.items():
        assert cells[name] == pytest.approx(value), name


def test_markdown_csv_and_the_view_carry_the_table(seeds_root):
    md = CliRunner().invoke(app, ["report", str(seeds_root), "--format", "md", "--k", "2"])
    assert md.exit_code == 0 and "Over seeds" in md.stdout and "pass@2" in md.stdout
    assert f"{100 * EXPECTED['maj@2']:.1f}" in md.stdout
    csv = CliRunner().invoke(app, ["report", str(seeds_root), "--format", "csv", "--k", "3"])
    assert csv.exit_code == 0 and "maj@3" in csv.stdout and f"{100 * EXPECTED['pass@3']:.1f}" in csv.stdout
    runs, notes = load_runs([seeds_root])
    table = _seeds_table(page_data(runs, notes)["report"]["tables"])  # the view's defaults: k = 1, 4, 8
    assert table["columns"][-3:] == ["avg@n", "pass@1", "maj@1"]  # 4 and 8 exceed the 3 seeds


def test_only_problems_every_seed_recorded_count(tmp_path):
    _write_seeds(tmp_path, {**VOTES, 4: [("1", True)]}, 3)  # problem 4 only in seed 0's run
    done = CliRunner().invoke(app, ["report", str(tmp_path), "--format", "json", "--k", "2"])
    assert done.exit_code == 0, done.output
    cells = dict(zip(*(lambda t: (t["columns"], t["rows"][0]))(_seeds_table(orjson.loads(done.stdout)["tables"]))))
    assert cells["problems"] == 4 and cells["pass@2"] == pytest.approx(EXPECTED["pass@2"])


def test_a_single_seed_has_no_seed_table(tmp_path):
    _write_seeds(tmp_path, VOTES, 1)
    done = CliRunner().invoke(app, ["report", str(tmp_path), "--format", "json"])
    assert done.exit_code == 0 and not [t for t in orjson.loads(done.stdout)["tables"] if t["name"] == "seeds"]


@pytest.mark.parametrize("k", ["0", "a", "2,-1", ""])
def test_bad_k_is_a_one_line_error(seeds_root, k):
    done = CliRunner().invoke(app, ["report", str(seeds_root), "--k", k])
    assert done.exit_code == 2 and "--k" in done.output and len(done.output.strip().splitlines()) == 1


def _maj2(*roots: Path) -> float:
    done = CliRunner().invoke(app, ["report", *map(str, roots), "--format", "json", "--k", "2"])
    assert done.exit_code == 0, done.output
    table = _seeds_table(orjson.loads(done.stdout)["tables"])
    return dict(zip(table["columns"], table["rows"][0]))["maj@2"]


def test_a_maj_at_k_tie_goes_to_the_lowest_seed_whatever_order_the_folders_come_in(tmp_path):
    """Seeds 2 and 10 tie 1-1: seed 2's answer wins, though its folder (`...-s2-...`) sorts after `...-s10-...`,
    and though the roots are given highest seed first."""
    _write_seeds(tmp_path / "one", {0: [("1", True), ("0", False)]}, [2, 10])
    folders = sorted(p.name for p in (tmp_path / "one" / "math500").iterdir())
    assert folders[0].startswith("bon-rkv-b64-n8-s10-")             # the folders' own order puts seed 10 first
    assert _maj2(tmp_path / "one") == 1.0
    _write_seeds(tmp_path / "low", {0: [("1", True)]}, [2])
    _write_seeds(tmp_path / "high", {0: [("0", False)]}, [10])
    assert _maj2(tmp_path / "high", tmp_path / "low") == 1.0
    _write_seeds(tmp_path / "flipped", {0: [("0", False), ("1", True)]}, [2, 10])   # seed 2 wrong: the tie is lost
    assert _maj2(tmp_path / "flipped") == 0.0
