"""What `kvrescue run` tells its user on stderr (here never a terminal, as in a log file under nohup or SLURM): the
grid's cells before they run, the models loading, plain progress lines, each cell's folder, a rerun that finds
everything done; and the options that shape a first run (`--preset cpu-demo`'s caps, `--out`, `-o`)."""

import re

import orjson
import pytest

from tests.helpers import kvrescue_run, ok

SMALL = ["--method", "bon", "--n", "2", "--budget", "16", "--max-step-tokens", "8", "--max-steps", "3",
         "--context-cap", "320", "--device", "cpu", "--batch", "2"]


@pytest.fixture(scope="module")
def first_run(tmp_path_factory, problems, qwen2_dir, prm_dir):
    """A two-cell grid (seeds 0 and 1) over three problems, and the same command again."""
    out = tmp_path_factory.mktemp("runs")
    args = ["--bench", str(problems), "--limit", "3", "--seed", "0,1", "--base", str(qwen2_dir), "--prm",
            str(prm_dir), "--out", str(out), *SMALL]
    first = ok(kvrescue_run(*args)).stderr.decode()
    again = ok(kvrescue_run(*args)).stderr.decode()
    return out, first, again


def test_a_log_file_shows_the_cells_the_loading_and_progress_lines(first_run):
    out, stderr, _ = first_run
    folders = sorted(p.relative_to(out) for p in out.glob("tiny/*"))
    assert f"2 cells, each in its run folder under {out}:" in stderr
    for folder in folders:  # listed before anything loads
        assert stderr.index(str(folder)) < stderr.index("loading base")
    assert re.search(r"^models loaded in \d+\.\d s$", stderr, re.M)
    for seed in (0, 1):  # a plain line when the cell starts and when its last problem is done
        label = f"tiny bon B=16 N=2 seed={seed}"
        assert re.search(rf"^\d\d:\d\d:\d\d {label}: 0/3 problems, .*eta after the first problem$", stderr, re.M)
        assert re.search(rf"^\d\d:\d\d:\d\d {label}: 3/3 problems, acc \d+\.\d%, \d+\.\d (step/s|s/step) "
                         rf"\d+\.\d (tok/s|s/tok), done$", stderr, re.M)
        assert stderr.count(f"{label}: 3/3 problems") == 1
    assert "\x1b[" not in stderr  # no live bar, no terminal codes


def test_each_cell_says_where_it_went_and_a_rerun_that_it_was_complete(first_run):
    out, first, again = first_run
    for folder in out.glob("tiny/*"):
        assert f"{folder}: 3 problems decoded" in first
        assert f"{folder}: complete, summarised" in again
    assert "loading" not in again


def test_synthetic_runs_show_no_accuracy_while_running(problems, qwen2_dir, prm_dir, tmp_path):
    """The summary's rule: a synthetic run's outputs are no answers (`acc n/a`, as in summary.json)."""
    done = ok(kvrescue_run("--bench", str(problems), "--limit", "2", "--base", str(qwen2_dir), "--prm", str(prm_dir),
                           "--out", str(tmp_path), "--synthetic-steps", "4:2", *SMALL))
    (summary,) = tmp_path.glob("tiny/*/summary.json")
    assert orjson.loads(summary.read_bytes())["accuracy"] is None
    assert ": 2/2 problems, acc n/a," in done.stderr.decode()


def test_cpu_demo_sets_the_demo_caps_and_given_options_win(problems, qwen2_dir, tmp_path):
    """--preset cpu-demo with local models (SmolLM2 is not fetched where both are given): the demo's caps, B and N
    recorded; --max-steps given on the command line and --n in --config win over the preset."""
    grid = tmp_path / "grid.toml"
    grid.write_text("n = 1\n")
    ok(kvrescue_run("--preset", "cpu-demo", "--base", str(qwen2_dir), "--helper", str(qwen2_dir), "--bench",
                    str(problems), "--limit", "1", "--method", "bon", "--max-steps", "1", "--config", str(grid),
                    "--out", str(tmp_path / "runs")))
    (config,) = (tmp_path / "runs").glob("tiny/*/config.json")
    cfg = orjson.loads(config.read_bytes())["config"]
    settings = cfg["settings"]
    assert (cfg["budget"], cfg["n"], cfg["scorer"]) == (16, 1, "helper-loglik")
    assert (settings["max_steps"], settings["max_step_tokens"], settings["context_cap"]) == (1, 192, 1024)
    assert settings["dtype"] == "float32" and settings["detector"] is None  # bon: no detector
    assert orjson.loads(config.read_bytes())["environment"]["devices"] == ["cpu"]


def test_an_out_inside_a_run_folder_is_refused_in_one_line(first_run, qwen2_dir, prm_dir, problems):
    out, _, _ = first_run
    folder = next(out.glob("tiny/*"))
    for inside in (folder, folder / "sub"):
        done = kvrescue_run("--bench", str(problems), "--base", str(qwen2_dir), "--prm", str(prm_dir),
                            "-o", str(inside), *SMALL)
        assert done.returncode == 2 and not (folder / "sub").exists()
        (line,) = done.stderr.decode().splitlines()
        assert f"run folder {folder}" in line and f"e.g. {out}" in line


def hub_cache(root, model: str, folder, refs: dict[str, str]):
    """A Hugging Face cache under `root` holding `model` at each ref (name -> commit), every snapshot a copy of
    `folder`."""
    import shutil

    repo = root / f"models--{model.replace('/', '--')}"
    (repo / "refs").mkdir(parents=True)
    for ref, commit in refs.items():
        (repo / "refs" / ref).write_text(commit)
        snapshot = repo / "snapshots" / commit
        if not snapshot.exists():
            shutil.copytree(folder, snapshot)
    return root


def test_a_hub_revision_is_loaded_and_recorded_only_when_given(monkeypatch, problems, qwen2_dir, prm_dir, tmp_path):
    """--base-revision v1 loads the base at the commit v1 names (from the local cache, offline) and records it;
    without it the folder is the one of main, with no `revisions` key (folders made before keep their hash)."""
    import huggingface_hub.constants

    v1, main = "1" * 40, "2" * 40
    cache = hub_cache(tmp_path / "hf", "kvtest/tiny", qwen2_dir, {"v1": v1, "main": main})
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    common = ["--bench", str(problems), "--limit", "1", "--base", "kvtest/tiny", "--prm", str(prm_dir), *SMALL]
    ok(kvrescue_run(*common, "--base-revision", "v1", "--out", str(tmp_path / "v1")))
    ok(kvrescue_run(*common, "--out", str(tmp_path / "main")))
    (pinned,) = (tmp_path / "v1").glob("tiny/*/config.json")
    (default,) = (tmp_path / "main").glob("tiny/*/config.json")
    pinned, default = (orjson.loads(p.read_bytes())["config"] for p in (pinned, default))
    assert pinned["models"]["base"]["revision"] == v1 and pinned["settings"]["revisions"] == {"base": "v1"}
    assert default["models"]["base"]["revision"] == main and "revisions" not in default["settings"]
    done = kvrescue_run(*common, "--prm-revision", "v1", "--out", str(tmp_path / "x"))
    assert done.returncode == 2 and "--prm-revision v1: the prm" in done.stderr.decode()
    assert "no Hub id" in done.stderr.decode()
