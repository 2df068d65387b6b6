"""Run folders stay under --out whatever the bench is called; resuming checks the problems themselves;
shards run one after the other into one folder keep their metadata and report as one run."""

from __future__ import annotations

import subprocess
from pathlib import Path

import orjson
import pytest

from kvrescue.outputs import CONFIG, RunFolder, RunFolderError, problem_checksum, run_dir
from kvrescue.report import load_runs
from tests.helpers import kvrescue
from tests.outputs.test_outputs import config, trace
from tests.report.test_report import write_run


@pytest.mark.parametrize("bench", ["...jsonl", "..jsonl", "..", ".", "../../../tmp/evil.jsonl", "/etc/passwd",
                                   "a/../../b", "\x00\x1b[31m\n.jsonl", ".hidden.jsonl", "x/..", "..\\..\\win.jsonl"])
def test_run_folder_never_leaves_the_root(bench: str, tmp_path: Path) -> None:
    root = tmp_path / "out"
    folder = run_dir(root, config(bench=bench)).resolve()
    assert folder.parent.parent == root.resolve()
    assert not folder.parent.name.startswith(".") and folder.parent.name.isprintable()


def checksums(texts: dict[int, str]) -> dict[int, str]:
    return {idx: problem_checksum(text, "\\boxed{1}") for idx, text in texts.items()}


def test_a_changed_problem_is_refused_by_name_unless_overwrite(tmp_path: Path) -> None:
    texts = {0: "problem 0", 1: "problem 1", 2: "problem 2"}
    with RunFolder.open(tmp_path, config(), total=3, problems=checksums(texts)) as folder:
        folder.append(trace(0))
        folder.append(trace(1))
    recorded = orjson.loads((tmp_path / CONFIG).read_bytes())["problems"]
    assert recorded == {str(k): v for k, v in checksums(texts).items()}
    with RunFolder.open(tmp_path, config(), total=3, problems=checksums(texts)) as folder:  # unchanged: resumes
        assert folder.done == {0, 1}
    for changed in ({**texts, 1: "problem 1, reworded"}, {**texts, 2: "problem 2, not yet run"}):
        first = min(k for k in texts if changed[k] != texts[k])
        with pytest.raises(RunFolderError, match=f"problem {first} .* has changed since it was run.*--overwrite"):
            RunFolder.open(tmp_path, config(), total=3, problems=checksums(changed))
    with RunFolder.open(tmp_path, config(), total=3, problems=checksums(changed), overwrite=True) as folder:
        assert folder.done == set()


def test_a_folder_without_recorded_checksums_is_checked_against_its_traces(tmp_path: Path) -> None:
    with RunFolder.open(tmp_path, config(), total=2) as folder:
        folder.append(trace(0))
    with pytest.raises(RunFolderError, match="problem 0 "):
        RunFolder.open(tmp_path, config(), total=2, problems=checksums({0: "problem 0 changed", 1: "problem 1"}))
    with RunFolder.open(tmp_path, config(), total=2, problems=checksums({0: "problem 0", 1: "problem 1"})) as folder:
        assert folder.done == {0}


def run_shard(path: Path, shard: tuple[int, int], idxs: list[int]) -> None:
    with RunFolder.open(path, config(), total=len(idxs), shard=shard) as folder:
        for idx in idxs:
            folder.append(trace(idx, started=float(idx)))
        folder.write_summary()


def test_shards_run_one_after_the_other_into_one_folder_keep_their_metadata(tmp_path: Path) -> None:
    folder = run_dir(tmp_path, config())
    run_shard(folder, (0, 3), [0, 3])
    run_shard(folder, (1, 3), [1, 4])
    stored = orjson.loads((folder / CONFIG).read_bytes())["run"]
    assert stored["shards"] == {"0/3": 2, "1/3": 2} and stored["shard"] == [1, 3]
    (run,), notes = load_runs([tmp_path])
    assert run.summary.problems == 4 and run.summary.total == 4
    assert run.in_progress == "shards 2/3 missing"
    run_shard(folder, (2, 3), [2, 5])
    (run,), notes = load_runs([tmp_path])
    assert (run.summary.problems, run.summary.total, run.summary.complete, run.in_progress) == (6, 6, True, None)
    summary = orjson.loads((folder / "summary.json").read_bytes())
    assert (summary["total"], summary["complete"]) == (6, True)


def test_run_into_a_bench_named_dots_and_resume_after_the_file_changed(qwen2_dir: Path, prm_dir: Path,
                                                                       tmp_path: Path) -> None:
    problems = tmp_path / "data" / "...jsonl"
    problems.parent.mkdir()
    rows = [{"question": f"What is {a} + 1?", "answer": str(a + 1)} for a in range(2)]
    problems.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in rows))
    args = ["run", "--bench", str(problems), "--method", "bon", "--n", "1", "--base", str(qwen2_dir),
            "--prm", str(prm_dir), "--out", str(tmp_path / "out"), "--max-step-tokens", "8", "--max-steps", "2",
            "--context-cap", "320", "--device", "cpu", "--batch", "2"]
    done = kvrescue(*args)
    assert done.returncode == 0, done.stderr.decode()[-3000:]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data", "out"]
    (bench_folder,) = (tmp_path / "out").iterdir()
    assert bench_folder.name == "bench"
    rows[1]["answer"] = "3"
    problems.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in rows))
    done = kvrescue(*args)
    lines = done.stderr.decode().strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1 and "problem 1 " in lines[0] and "--overwrite" in lines[0], lines
    done = kvrescue(*args, "--overwrite")
    assert done.returncode == 0, done.stderr.decode()[-3000:]


@pytest.fixture
def two_runs(tmp_path: Path) -> Path:
    root = tmp_path / "runs"
    write_run(root, "bon", correct={0, 1})
    write_run(root, "full", correct={0, 1, 2})
    broken = root / "math500" / "broken"
    broken.mkdir(parents=True)
    (broken / CONFIG).write_text("{")
    return root


def report_cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return kvrescue("report", *args, cwd=cwd, text=True)


def test_report_csv_sends_its_notes_to_stderr(two_runs: Path) -> None:
    done = report_cli(str(two_runs), "--format", "csv", cwd=two_runs)
    assert done.returncode == 0, done.stderr
    assert "broken" not in done.stdout and "not valid JSON" not in done.stdout
    assert "broken" in done.stderr and "not valid JSON" in done.stderr
    assert done.stdout.startswith("table,row,") and "\nruns," in done.stdout and "Traceback" not in done.stderr


@pytest.mark.parametrize(("target", "message"), [
    ("folder", "--plot folder: is a directory, not a file"),
    ("figure.jpg", "--plot figure.jpg: the plot is written as PNG; name a .png file"),
    ("plain/figure.png", "--plot plain/figure.png: plain is a file, not a folder"),
])
def test_report_plot_to_a_path_that_cannot_be_a_png(target: str, message: str, two_runs: Path) -> None:
    (two_runs / "folder").mkdir()
    (two_runs / "plain").write_text("a file")
    done = report_cli(str(two_runs), "--plot", target, cwd=two_runs)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and lines == [f"error: {message}"], done.stderr
    assert not (two_runs / "figure.jpg").exists()


def test_report_plot_says_which_file_it_wrote(two_runs: Path) -> None:
    done = report_cli(str(two_runs), "--plot", "figure", cwd=two_runs)
    assert done.returncode == 0, done.stderr
    assert (two_runs / "figure.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and not (two_runs / "figure").exists()
    assert "wrote figure.png" in done.stderr
