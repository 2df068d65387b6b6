"""`kvrescue run --config FILE.toml`: the shipped grids parse into the paper's, the command line overrides the
file, a folder made from a file is the folder made from the same flags, and bad files are one-line errors."""

from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from kvrescue import runs
from kvrescue.cli import app, run_option_kinds
from kvrescue.config_file import read_grid_file
from kvrescue.data import ProblemSet
from kvrescue.grid import GridOptions
from tests.helpers import ROOT, kvrescue_run, ok
from tests.cli.test_run_options import MODELS, folders

EXAMPLES = ROOT / "examples"
PAPER_METHODS = ["full", "helper", "bon", "kvrescue"]
FIVE_SEEDS = [0, 1, 2, 3, 4]


def grid_of(monkeypatch, *args: str) -> GridOptions:
    """The GridOptions `kvrescue run ARGS` hands to `run_grid` (which is replaced: nothing is decoded)."""
    seen: list[GridOptions] = []
    monkeypatch.setattr(runs, "run_grid", lambda options, progress: seen.append(options) or [])
    done = CliRunner().invoke(app, ["run", *args])
    assert done.exit_code == 0, done.output
    (options,) = seen
    return options


def cells(options: GridOptions) -> set[tuple]:
    """(bench, method, budget, n, seed) of every cell, from the grid's own rule."""
    sets = [ProblemSet(name=b, source=b, grading_bench=b, problems=[]) for b in options.benches]
    return {(c.problems.name, c.method, c.budget, c.n, c.seed) for c in options.cells(sets)}


def paper_cells(benches: list[str], methods: list[str], budgets: list[int], seeds: list[int],
                ns: tuple[int, ...] = (8,)) -> set[tuple]:
    return {(b, m, budget if m in ("bon", "interleave", "kvrescue") else None, n, s)
            for b in benches for m in methods for budget in budgets for s in seeds for n in ns}


MAIN_GRID_BUDGETS = [64, 128, 256, 512]
ONE_SEED_BENCHES = ["math500", "gsm8k", "olympiadbench"]
FIVE_SEED_BENCHES = ["aime24", "amc23"]


def main_results(methods: list[str], ns: tuple[int, ...]) -> set[tuple]:
    """Table 5's grid: one seed on MATH500, GSM8K and OlympiadBench, five on AIME24 and AMC23."""
    return (paper_cells(ONE_SEED_BENCHES, methods, MAIN_GRID_BUDGETS, [0], ns)
            | paper_cells(FIVE_SEED_BENCHES, methods, MAIN_GRID_BUDGETS, FIVE_SEEDS, ns))


@pytest.mark.parametrize("name, base, tp", [("paper-7b.toml", "Qwen/Qwen2.5-Math-7B-Instruct", 1),
                                            ("paper-72b-tp8.toml", "Qwen/Qwen2.5-Math-72B-Instruct", 8)])
def test_the_main_results_files_are_table_5s_grid(monkeypatch, name, base, tp):
    # the 72B file names 8 GPUs; on this machine the command line gives the CPU instead (and overrides the file)
    options = grid_of(monkeypatch, "--config", str(EXAMPLES / name), "--devices", "cpu")
    assert options.models == {"base": base, "helper": "Qwen/Qwen2.5-Math-1.5B-Instruct",
                              "prm": "Qwen/Qwen2.5-Math-PRM-7B"}
    assert options.scorer == "prm" and options.evictor == "rkv" and options.tp == tp
    assert cells(options) == main_results(PAPER_METHODS, (1, 8))          # full and helper references, N 1 and 8
    assert len(cells(options)) == 2 * (3 * (2 + 2 * 4) + 2 * 5 * (2 + 2 * 4))


def test_the_72b_file_names_eight_gpus():
    command = typer.main.get_command(app).commands["run"]
    kinds = run_option_kinds(typer.Context(command))
    assert read_grid_file(EXAMPLES / "paper-72b-tp8.toml", *kinds).options["devices"] == \
        ",".join(f"cuda:{i}" for i in range(8))


def test_the_ablation_file_is_table_2s_grid(monkeypatch):
    options = grid_of(monkeypatch, "--config", str(EXAMPLES / "paper-ablation.toml"), "--devices", "cpu")
    assert options.models["base"] == "Qwen/Qwen2.5-Math-7B-Instruct" and options.evictor == "rkv"
    assert cells(options) == paper_cells(["math500"], ["full", "bon", "interleave", "kvrescue"], [64], [0])


@pytest.mark.parametrize("batch", [8, 64])
def test_the_throughput_files_are_table_3s_setting(monkeypatch, batch):
    options = grid_of(monkeypatch, "--config", str(EXAMPLES / f"paper-throughput-batch{batch}.toml"),
                      "--devices", "cpu")
    assert options.tp == 8 and options.models["base"] == "Qwen/Qwen2.5-Math-72B-Instruct"
    assert options.settings.batch == batch and options.out == Path(f"runs/paper-throughput-batch{batch}")
    assert cells(options) == paper_cells(["math500"], ["full", "bon", "kvrescue"], [64], [0])


def test_the_snapkv_file_is_figure_10s_grid(monkeypatch):
    options = grid_of(monkeypatch, "--config", str(EXAMPLES / "paper-snapkv.toml"), "--devices", "cpu")
    assert options.evictor == "snapkv" and options.models["base"] == "Qwen/Qwen2.5-Math-7B-Instruct"
    assert cells(options) == main_results(["full", "bon", "kvrescue"], (8,))


def test_the_n_sweep_file_is_figure_1bs_grid(monkeypatch):
    options = grid_of(monkeypatch, "--config", str(EXAMPLES / "paper-n-sweep.toml"), "--devices", "cpu")
    assert cells(options) == paper_cells(["math500"], ["full", "bon", "kvrescue"], [64], [0], (1, 2, 4, 8, 16))


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "grid.toml"
    path.write_text(text)
    return path


def test_the_command_line_overrides_the_file(monkeypatch, tmp_path):
    path = write(tmp_path, 'n = 8\ntemperature = 0.5\ntop-k = 5\nproblem_field = "q"\nbench = ["gsm8k"]\n'
                           '[[grid]]\nseed = [1, 2]\n[[grid]]\nseed = 7\nmethod = "bon"\n')
    options = grid_of(monkeypatch, "--config", str(path), "--devices", "cpu", "--n", "2", "--top-k", "9",
                      "--seed", "3")
    assert options.ns == [2] and options.settings.sampling.top_k == 9  # the command line
    assert options.settings.sampling.temperature == 0.5 and options.problem_field == "q"  # the file
    assert cells(options) == {("gsm8k", "kvrescue", 64, 2, 3), ("gsm8k", "bon", 64, 2, 3)}  # --seed in every grid


def test_a_file_and_the_same_flags_make_the_same_folders(tmp_path, problems, qwen2_dir, prm_dir):
    out = tmp_path / "runs"
    path = write(tmp_path, f'bench = "{problems}"\nmethod = ["bon", "kvrescue"]\nbudget = 16\nn = 2\nlimit = 2\n'
                           f'base = "{qwen2_dir}"\nhelper = "{qwen2_dir}"\nprm = "{prm_dir}"\ndevice = "cpu"\nout = "{out}"\n'
                           'synthetic-steps = "48:2"\nmax-step-tokens = 48\ncontext-cap = 1024\n')
    ok(kvrescue_run("--config", str(path)))
    made = folders(out)
    assert sorted(made) == ["tiny/bon-rkv-b16-n2-s0", "tiny/kvrescue-rkv-b16-n2-s0"]
    written = {name: (p / "traces.jsonl").read_bytes() for name, p in made.items()}
    again = ok(kvrescue_run("--bench", str(problems), "--method", "bon,kvrescue", "--budget", "16", "--n", "2",
                            "--limit", "2", *MODELS(qwen2_dir, prm_dir), "--helper", str(qwen2_dir), "--out", str(out), "--synthetic-steps", "48:2",
                            "--max-step-tokens", "48", "--context-cap", "1024"))
    assert folders(out) == made  # the same folders (no note of a folder with other settings), nothing decoded again
    assert b"note:" not in again.stderr
    assert {name: (p / "traces.jsonl").read_bytes() for name, p in made.items()} == written


@pytest.mark.parametrize("text, says", [
    ("bnech = 'math500'\n", "unknown key 'bnech'"),
    ("n = 'eight'\n", "key 'n': expected an integer or a non-empty list of them, got str 'eight'"),
    ("temperature = 'hot'\n", "key 'temperature': expected a number"),
    ("top-k = 2.5\n", "key 'top-k': expected an integer"),
    ("overwrite = 1\n", "key 'overwrite': expected true or false"),
    ("limit = true\n", "key 'limit': expected an integer"),
    ("budget = []\n", "key 'budget': expected an integer or a non-empty list"),
    ("problem-field = 'a'\nproblem_field = 'b'\n", "key 'problem_field' conflicts with key 'problem-field'"),
    ("limit = 0\n", "key 'limit':"),
    ("[[grid]]\ntemperature = 0.5\n", "[[grid]] 1: key 'temperature': a [[grid]] gives only the axes"),
    ("grid = 3\n", "key 'grid': expected [[grid]] tables"),
    ("n = [8\n", "not valid TOML"),
    # beyond a grid file's shape, refused before tomllib parses: its cost is quadratic in a dotted key's parts, and
    # deep nesting ends in its RecursionError
    ("a" + ".a" * 10000 + " = 1\n", "a dotted key of more than 8 parts (a.a.a.a"),
    ("n = " + "[" * 100000 + "]" * 100000 + "\n", "brackets or braces nested more than 16 deep"),
    ("x = {" * 20 + "}" * 20 + "\n", "nested more than 16 deep"),
])
def test_bad_files_are_one_line_errors(tmp_path, text, says):
    path = write(tmp_path, text)
    done = CliRunner().invoke(app, ["run", "--config", str(path), "--devices", "cpu"])
    assert done.exit_code == 2, done.output
    lines = done.output.strip().splitlines()
    assert len(lines) == 1 and str(path) in lines[0] and says in lines[0], done.output


def test_dots_and_brackets_in_strings_and_comments_are_not_keys(monkeypatch, tmp_path):
    deep = "[" * 20 + "a.b.c.d.e.f.g.h.i.j" + "]" * 20
    path = write(tmp_path, f"problem-field = '{deep}'  # {deep}\nanswer-field = \"{deep}\"\ntemperature = 0.5\n")
    options = grid_of(monkeypatch, "--config", str(path), "--devices", "cpu")
    assert options.problem_field == options.answer_field == deep and options.settings.sampling.temperature == 0.5


def test_a_folder_or_an_oversized_file_is_refused(tmp_path):
    for path, says in ((tmp_path, "not a regular file"), (write(tmp_path, "#" * (2 << 20)), "larger than")):
        done = CliRunner().invoke(app, ["run", "--config", str(path)])
        assert done.exit_code == 2 and says in done.output and len(done.output.strip().splitlines()) == 1
