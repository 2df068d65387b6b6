"""`kvrescue run` end to end on tiny random checkpoints: folders, traces, accounting, seeds, resume."""

import base64
import gzip
import os
import re
import shutil
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import orjson
import pytest

from kvrescue.engine.loader import resolve_dtype
from tests.helpers import KVRESCUE, RUN_WAIT_S, blind_prm, kvrescue, kvrescue_run, ok, read_folder, small_grid

METHODS = ("kvrescue", "interleave", "bon", "full", "helper")
SMALL = ["--max-step-tokens", "12", "--max-steps", "12", "--context-cap", "320", "--budget", "16",
         "--temperature", "1.0", "--top-k", "0", "--top-p", "1.0", "--device", "cpu", "--batch", "2",
         "--ent-window", "6", "--ent-min-tokens", "10", "--cmp-chars", "200"]


@pytest.fixture(scope="module")
def grid(tmp_path_factory, problems, qwen2_dir, llama_dir, prm_dir) -> Path:
    out = tmp_path_factory.mktemp("runs")
    done = kvrescue_run("--bench", str(problems), "--method", ",".join(METHODS), "--n", "2", "--limit", "3",
                        "--base", str(qwen2_dir), "--helper", str(llama_dir), "--prm", str(prm_dir),
                        "--out", str(out), *SMALL)
    assert done.returncode == 0, done.stderr.decode()[-3000:]
    return out


def test_grid_writes_one_folder_per_method(grid):
    assert sorted(p.name.split("-")[0] for p in (grid / "tiny").iterdir()) == sorted(METHODS)
    for method in METHODS:
        config, traces, summary = read_folder(grid, method)
        assert config["config"]["method"] == method
        assert sorted(t["idx"] for t in traces) == [0, 1, 2]
        assert summary["problems"] == 3 and summary["complete"]
        assert {"accuracy", "mean_steps", "base_tokens", "helper_tokens", "prm_tokens", "helper_step_share",
                "early_exit_rate", "degeneration_rate", "throughput_per_min", "wall_s"} <= set(summary)
        assert summary["scorer"] == "prm" and config["config"]["models"]["prm"]["id"]
        # --dtype auto, resolved for this machine's CPU and recorded
        assert config["config"]["settings"]["dtype"] == resolve_dtype("auto", "cpu")
        assert all(ref["revision"].startswith("sha256:") for ref in config["config"]["models"].values())
        detector = config["config"]["settings"]["detector"]
        if method == "kvrescue":
            assert {k: detector[k] for k in ("ent_window", "min_tokens", "cmp_chars")} == \
                {"ent_window": 6, "min_tokens": 10, "cmp_chars": 200}


def test_traces_follow_the_method(grid):
    for method in METHODS:
        _, traces, _ = read_folder(grid, method)
        for trace in traces:
            assert trace["n_steps"] == len(trace["steps"]) == len(trace["candidates"]) >= 1
            assert trace["output"] == "".join(s["text"] for s in trace["steps"])
            sources = {c["source"] for cands in trace["candidates"] for c in cands}
            expected = {"kvrescue": {"base", "helper"}, "interleave": {"base", "helper"}, "bon": {"base"},
                        "full": {"base"}, "helper": {"helper"}}[method]
            assert sources == expected
            for cands in trace["candidates"]:
                assert len(cands) == 2 * len(expected)
                assert sum(c["committed"] for c in cands) == 1
            tokens = trace["tokens"]
            generated = {s: sum(c["tokens"] for cands in trace["candidates"] for c in cands if c["source"] == s)
                         for s in ("base", "helper")}
            assert tokens["base"] == generated["base"] and tokens["helper"] == generated["helper"]
            if method in ("kvrescue", "interleave"):
                # Both models hold the same trajectory: each appended the other's committed steps to its prompt, all
                # but the last (the problem stops at it: it is never appended).
                by_source = {s: sum(st["tokens"] for st in trace["steps"][:-1] if st["source"] == s)
                             for s in ("base", "helper")}
                assert tokens["base_prefill"] - by_source["helper"] == tokens["helper_prefill"] - by_source["base"] > 0
            assert trace["stop"] in ("eos", "context", "steps")
            if method == "kvrescue":
                assert all(c["max_mean_entropy"] is not None for cands in trace["candidates"]
                           for c in cands if c["source"] == "base" and c["tokens"] >= 24)
            if method == "helper":
                assert trace["peak_base_rows"] == 0 and tokens["base"] == tokens["base_prefill"] == 0


def test_evicted_base_is_bounded(grid):
    _, traces, _ = read_folder(grid, "bon")
    assert max(t["peak_base_rows"] for t in traces) <= 16 + 128 + 12 + 64  # B' + one append (prompt or step)


def test_candidates_record_their_text(grid):
    for method in METHODS:
        _, traces, _ = read_folder(grid, method)
        for trace in traces:
            for step, cands in zip(trace["steps"], trace["candidates"]):
                for c in cands:
                    if c["committed"]:
                        assert c["text"] is None  # the step's text
                    else:
                        assert isinstance(c["text"], str)
                        assert c["finish"] != "step" or "\n\n" in c["text"]


def test_view_of_the_grid_holds_its_traces(grid, tmp_path):
    """`kvrescue view` on real run folders: every trace, candidates' texts and cache lengths included."""
    page = tmp_path / "runs.html"
    done = kvrescue("view", str(grid), "--out", str(page))
    assert done.returncode == 0, done.stderr.decode()[-3000:]
    html = page.read_text(encoding="utf-8")
    chunks = {}
    for run, number, packed in re.findall(r'id="kv-run-([0-9]+)-([0-9]+)">([^<]*)<', html):
        chunks.setdefault(int(run), []).extend(orjson.loads(gzip.decompress(base64.b64decode(packed))))
    index = orjson.loads(gzip.decompress(base64.b64decode(re.search(r'id="kv-data">([^<]*)<', html).group(1))))
    assert sorted(r["method"] for r in index["runs"]) == sorted(METHODS)
    for run in index["runs"]:
        _, traces, _ = read_folder(grid, run["method"])
        shown = sorted(chunks[run["id"]], key=lambda t: t["idx"])
        assert [{k: v for k, v in t.items() if k not in ("problem", "gt", "gt_norm", "output")}
                for t in sorted(traces, key=lambda t: t["idx"])] == shown


def test_each_step_records_the_base_cache_length(grid):
    for method in METHODS:
        _, traces, _ = read_folder(grid, method)
        for trace in traces:
            rows = [step["base_rows"] for step in trace["steps"]]
            if method == "helper":
                assert rows == [None] * len(rows)
                continue
            assert max(rows) <= trace["peak_base_rows"]
            if method == "full":
                # Nothing evicted: the row holds the prompt and every committed token, but the last step's last
                # token (sampled, never fed: the problem stopped there).
                prompt = trace["tokens"]["base_prefill"] - sum(s["tokens"] for s in trace["steps"] if s["source"] == "helper")
                held = [prompt + sum(s["tokens"] for s in trace["steps"][:i + 1]) for i in range(len(rows))]
                held[-1] -= 1
                assert rows == held
            else:
                assert max(rows) < 16 + 128  # compressed to B whenever it reaches B' = B + 128


def test_qwen3_base_and_helper_run_end_to_end(problems, qwen3_dir, prm_dir, tmp_path):
    """A Qwen3 base on the evicting cache and a Qwen3 helper: every problem decoded, the base bounded."""
    done = kvrescue_run("--bench", str(problems), "--method", "kvrescue", "--n", "2", "--limit", "2",
                        "--base", str(qwen3_dir), "--helper", str(qwen3_dir), "--prm", str(prm_dir),
                        "--out", str(tmp_path), *SMALL)
    assert done.returncode == 0, done.stderr.decode()[-3000:]
    config, traces, summary = read_folder(tmp_path, "kvrescue")
    assert config["config"]["models"]["base"]["id"] == str(qwen3_dir) and len(traces) == 2
    assert config["config"]["settings"]["prompt"] == "qwen3-think"  # --prompt auto, by the config's model_type
    assert all(t["stop"] != "skipped" and t["n_steps"] >= 1 for t in traces)
    assert max(t["peak_base_rows"] for t in traces) <= 16 + 128 + 12


def test_same_seed_gives_identical_traces(grid, problems, qwen2_dir, llama_dir, prm_dir, tmp_path):
    done = kvrescue_run("--bench", str(problems), "--method", "kvrescue", "--n", "2", "--limit", "3",
                        "--base", str(qwen2_dir), "--helper", str(llama_dir), "--prm", str(prm_dir),
                        "--out", str(tmp_path), *SMALL)
    assert done.returncode == 0, done.stderr.decode()[-3000:]
    strip = lambda t: {k: v for k, v in t.items() if k != "timings"}  # noqa: E731
    first = sorted(map(strip, read_folder(grid, "kvrescue")[1]), key=lambda t: t["idx"])
    again = sorted(map(strip, read_folder(tmp_path, "kvrescue")[1]), key=lambda t: t["idx"])
    assert first == again


def test_rerun_of_a_complete_cell_decodes_nothing(grid, problems, qwen2_dir, llama_dir, prm_dir):
    before = read_folder(grid, "bon")[1]
    done = kvrescue_run("--bench", str(problems), "--method", "bon", "--n", "2", "--limit", "3",
                        "--base", str(qwen2_dir), "--prm", str(prm_dir), "--out", str(grid), *SMALL)
    assert done.returncode == 0, done.stderr.decode()[-3000:]
    assert read_folder(grid, "bon")[1] == before


def table(stderr: bytes) -> list[str]:
    """The rows of the final table (after its title, one line per cell at the width of a log)."""
    return [line for line in re.split(r"kvrescue run *\n", stderr.decode())[-1].splitlines() if "seed=" in line]


def unloadable(tmp_path: Path, model: Path) -> tuple[Path, Callable[[], object]]:
    """A copy of `model` under `tmp_path` and a function that makes its tokenizer unreadable: loading it is then a
    one-line error, while the run folders' identity (config.json and the weights' index, `model_revision`) stays."""
    copy = shutil.copytree(model, tmp_path / model.name)
    return copy, lambda: (copy / "tokenizer.json").write_text("not a tokenizer")


def test_a_rerun_of_a_complete_grid_loads_no_model(problems, qwen2_dir, prm_dir, tmp_path):
    """A rerun of a grid whose cells are all complete only summarises them: with a base it could not load, it
    prints the same table and leaves every file but config.json as it was, config.json keeping the environment of
    the run that decoded the traces."""
    base, break_tokenizer = unloadable(tmp_path, qwen2_dir)
    args = ["--bench", str(problems), "--method", "bon,full", "--n", "2", "--limit", "2", "--base", str(base),
            "--prm", str(prm_dir), "--out", str(tmp_path / "runs"), *SMALL]
    first = ok(kvrescue_run(*args))
    configs = sorted((tmp_path / "runs").glob("tiny/*/config.json"))
    files = lambda: {p: p.read_bytes() for p in (tmp_path / "runs").glob("tiny/*/*") if p not in configs}  # noqa: E731
    written = files()
    assert len(configs) == 2
    environments = [orjson.loads(c.read_bytes())["environment"] for c in configs]
    assert all(e["executor"]["kind"] == "in-process" for e in environments)
    break_tokenizer()
    again = ok(kvrescue_run(*args))
    assert table(again.stderr) == table(first.stderr) and len(table(first.stderr)) == 2
    assert files() == written
    for path, recorded in zip(configs, environments):
        stored = orjson.loads(path.read_bytes())
        assert stored["run"]["total"] == 2 and stored["environment"] == recorded


def test_a_grid_with_a_problem_left_loads_the_models_first_and_decodes_only_what_is_left(problems, qwen2_dir, prm_dir,
                                                                                          tmp_path):
    """One complete cell and one with a problem left: the models are loaded before any folder is opened (a base
    that cannot load is a one-line error touching nothing), then only the missing problem is decoded and the
    complete cell's traces stay as they were."""
    base, break_tokenizer = unloadable(tmp_path, qwen2_dir)
    args = ["--bench", str(problems), "--method", "bon,full", "--n", "2", "--limit", "2", "--base", str(base),
            "--prm", str(prm_dir), "--out", str(tmp_path / "runs"), *SMALL]
    ok(kvrescue_run(*args))
    (full,) = (tmp_path / "runs").glob("tiny/full-*/traces.jsonl")
    kept = full.read_bytes().splitlines(keepends=True)[0]
    full.write_bytes(kept)  # the full cell is left with one of its two problems
    files = lambda: {p: p.read_bytes() for p in (tmp_path / "runs").glob("tiny/*/*")}  # noqa: E731
    before = files()
    tokenizer = (base / "tokenizer.json").read_bytes()
    break_tokenizer()
    refused = kvrescue_run(*args)
    assert refused.returncode == 2 and b"tokenizer" in refused.stderr and b"Traceback" not in refused.stderr
    assert files() == before
    (base / "tokenizer.json").write_bytes(tokenizer)
    ok(kvrescue_run(*args))
    after = files()
    bon = lambda files: {p: b for p, b in files.items()  # noqa: E731
                         if p.parent.name.startswith("bon-") and p.name != "config.json"}
    assert bon(after) == bon(before) and len(bon(before)) == 3  # .lock, traces.jsonl, summary.json
    lines = after[full].splitlines(keepends=True)
    assert lines[0] == kept and sorted(orjson.loads(line)["idx"] for line in lines) == [0, 1]


def test_a_folder_of_another_configuration_is_refused_before_any_model_is_loaded(problems, qwen2_dir, prm_dir,
                                                                                 tmp_path):
    """A grid one of whose folders holds another configuration is refused in that folder's one line before any
    model is loaded (a base that could not load says nothing) and before any other folder is made."""
    base, break_tokenizer = unloadable(tmp_path, qwen2_dir)
    args = ["--bench", str(problems), "--n", "2", "--limit", "2", "--base", str(base), "--prm", str(prm_dir),
            "--out", str(tmp_path / "runs"), *SMALL]
    ok(kvrescue_run(*args, "--method", "bon"))
    (config,) = (tmp_path / "runs").glob("tiny/bon-*/config.json")
    stored = orjson.loads(config.read_bytes())
    stored["config"]["settings"]["top_k"] = 5
    config.write_bytes(orjson.dumps(stored))
    break_tokenizer()
    done = kvrescue_run(*args, "--method", "full,bon")
    assert done.returncode == 2 and b"holds a different configuration (settings.top_k: 5 -> 0)" in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1
    assert [p.name for p in (tmp_path / "runs" / "tiny").iterdir()] == [config.parent.name]  # no full folder


def test_a_different_configuration_in_the_same_folder_is_refused(grid, problems, qwen2_dir, prm_dir):
    config, _, _ = read_folder(grid, "bon")
    folder = next(p for p in (grid / "tiny").iterdir() if p.name.startswith("bon-"))
    stored = orjson.loads((folder / "config.json").read_bytes())
    stored["config"]["settings"]["top_k"] = 5
    (folder / "config.json").write_bytes(orjson.dumps(stored))
    done = kvrescue_run("--bench", str(problems), "--method", "bon", "--n", "2", "--limit", "3",
                        "--base", str(qwen2_dir), "--prm", str(prm_dir), "--out", str(grid), *SMALL)
    assert done.returncode == 2 and b"different configuration" in done.stderr and b"--overwrite" in done.stderr
    (folder / "config.json").write_bytes(orjson.dumps(config))


def test_a_folder_from_before_model_revisions_is_named_and_left_alone(grid, problems, qwen2_dir, prm_dir, tmp_path):
    """A run folder written before config.json recorded model revisions holds `revision: null`, so its configuration
    (and folder name) differs: the run says so in one line naming it and the field, and starts a new folder."""
    from kvrescue.outputs import RunConfig

    config, _, _ = read_folder(grid, "bon")
    old_config = orjson.loads(orjson.dumps(config))
    for ref in old_config["config"]["models"].values():
        ref["revision"] = None
    old = tmp_path / "tiny" / RunConfig.from_dict(old_config["config"]).folder_name()
    old.mkdir(parents=True)
    (old / "config.json").write_bytes(orjson.dumps(old_config))
    (old / "traces.jsonl").write_bytes(b"")
    done = kvrescue_run("--bench", str(problems), "--method", "bon", "--n", "2", "--limit", "1",
                        "--base", str(qwen2_dir), "--prm", str(prm_dir), "--out", str(tmp_path), *SMALL)
    assert done.returncode == 0, done.stderr.decode()[-3000:]
    revision = config["config"]["models"]["base"]["revision"]
    note = f"note: {old} holds this cell with other settings (models.base.revision: None -> '{revision}', " \
           f"models.prm.revision: None -> "
    assert note in done.stderr.decode().replace("\n", "")
    assert orjson.loads((old / "config.json").read_bytes()) == old_config and (old / "traces.jsonl").read_bytes() == b""
    (new,) = [p for p in (tmp_path / "tiny").iterdir() if p != old]
    assert len((new / "traces.jsonl").read_bytes().splitlines()) == 1


def test_killed_run_resumes_with_one_line_per_problem(problems, qwen2_dir, llama_dir, prm_dir, tmp_path):
    args = [KVRESCUE, "run", "--bench", str(problems), "--method", "kvrescue", "--n", "2", "--base", str(qwen2_dir),
            "--helper", str(llama_dir), "--prm", str(prm_dir), "--out", str(tmp_path), *SMALL]
    process = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + RUN_WAIT_S
    traces = None
    while time.time() < deadline and process.poll() is None:
        found = list(tmp_path.glob("tiny/*/traces.jsonl"))
        if found and found[0].read_bytes().count(b"\n") >= 1:
            traces = found[0]
            break
        time.sleep(0.05)
    os.kill(process.pid, signal.SIGKILL)
    process.wait()
    assert traces is not None, "the run wrote no trace before the deadline"
    written = traces.read_bytes()
    done = kvrescue(*args[1:])  # the resume, in this process
    assert done.returncode == 0, done.stderr.decode()[-3000:]
    after = traces.read_bytes()
    complete_before = written[: written.rfind(b"\n") + 1]
    assert after.startswith(complete_before)  # nothing finished before the kill was lost or rewritten
    idx = [orjson.loads(line)["idx"] for line in after.splitlines()]
    assert sorted(idx) == list(range(6))


@pytest.mark.parametrize(
    "args, message",
    [
        (["--method", "beam"], b"unknown method 'beam'"),
        (["--budget", "8"], b"--budget 8 is below"),
        (["--n", "0"], b"--n 0"),
        (["--evictor", "h3o"], b"unknown evictor 'h3o'"),
        (["--evictor", "rkv:kernel=4"], b"--evictor rkv: kernel=4: the max-pool kernel must be odd and positive"),
        (["--evictor", "rkv:lambda=0.2"], b"is not FIELD=VALUE of one of rkv's parameters (lam, kernel, threshold)"),
        (["--buffer", "0"], b"--buffer 0: need at least 1"),
        (["--prm-format", "chat"], b"--prm-format 'chat': expected paper or model-card"),
        (["--prm-recipe", "chat"], b"unknown --prm-recipe 'chat': use one of auto, qwen-math, rlhflow, math-shepherd"),
        (["--bench", "nonexistent-bench"], b"unknown benchmark 'nonexistent-bench'"),
        (["--base", "/no/such/folder"], b"base model"),
        (["--prm", "SOME_FOLDER_THAT_IS_NOT_A_PRM"], b"no PRM head"),
    ],
)
def test_bad_options_are_one_line_errors(args, message, problems, qwen2_dir, llama_dir, prm_dir, tmp_path):
    args = [str(qwen2_dir) if a == "SOME_FOLDER_THAT_IS_NOT_A_PRM" else a for a in args]
    base = ["--bench", str(problems), "--base", str(qwen2_dir), "--helper", str(llama_dir), "--prm", str(prm_dir),
            "--out", str(tmp_path), "--limit", "1", *SMALL]
    done = kvrescue_run(*base, *args)
    assert done.returncode == 2, done.stderr.decode()[-2000:]
    assert message in done.stderr and b"Traceback" not in done.stderr


def test_default_models_without_the_hub_name_the_model_and_the_way_out(problems, tmp_path):
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    done = subprocess.run([KVRESCUE, "run", "--bench", str(problems), "--limit", "1", "--out", str(tmp_path)],
                          capture_output=True, timeout=300, env=env)
    assert done.returncode == 2
    assert b"Qwen/Qwen2.5-Math" in done.stderr and b"--preset cpu-demo" in done.stderr


@pytest.fixture(scope="module")
def flat_dir(tmp_path_factory) -> Path:
    """A Qwen2 with a near-uniform next-token distribution over its 512 tokens (6.24 nats), 4096 embedding rows."""
    from kvrescue_testkit.random_checkpoints import write_random_checkpoint

    return write_random_checkpoint(tmp_path_factory.mktemp("flat"), "qwen2", vocab_size=4096, init_std=0.002, seed=5,
                                   hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128)


def test_detector_early_exits_are_in_the_traces(problems, flat_dir, llama_dir, prm_dir, tmp_path):
    args = ["--bench", str(problems), "--n", "2", "--limit", "2", "--base", str(flat_dir), "--helper", str(llama_dir),
            "--prm", str(prm_dir), *SMALL, "--max-step-tokens", "30", "--max-steps", "2", "--tau-ent", "6.0"]
    done = kvrescue_run(*args, "--method", "kvrescue,interleave", "--out", str(tmp_path))
    assert done.returncode == 0, done.stderr.decode()[-3000:]
    _, traces, summary = read_folder(tmp_path, "kvrescue")
    base = [c for t in traces for cands in t["candidates"] for c in cands if c["source"] == "base"]
    # a flat model fires at the first eligible token: --ent-min-tokens 10 (in SMALL)
    assert base and all(c["finish"] == "entropy" and c["fired_at"] == 10 and c["score"] is None for c in base)
    assert all(c["max_mean_entropy"] > 6.0 for c in base)  # and the padding rows past 512 were never sampled
    assert all(s["source"] == "helper" for t in traces for s in t["steps"])  # only helper candidates survive
    assert summary["early_exit_rate"] == 1.0
    _, traces, summary = read_folder(tmp_path, "interleave")  # the ablation: same models, detector off
    assert all(c["finish"] != "entropy" and c["max_mean_entropy"] is None
               for t in traces for cands in t["candidates"] for c in cands)
    assert summary["early_exit_rate"] == 0.0


def test_a_problem_longer_than_the_context_cap_is_skipped_and_the_run_goes_on(qwen2_dir, prm_dir, tmp_path):
    path = tmp_path / "tiny.jsonl"
    rows = [{"question": "What is 2 + 2?", "answer": "4"}, {"question": "Add these: " + "1 + " * 300 + "1", "answer": "301"},
            {"question": "What is 3 + 3?", "answer": "6"}]
    path.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in rows))
    done = kvrescue_run("--bench", str(path), "--method", "bon", "--n", "2", "--base", str(qwen2_dir), "--prm",
                        str(prm_dir), "--out", str(tmp_path / "runs"), *SMALL)
    assert done.returncode == 0, done.stderr.decode()[-3000:]
    _, traces, summary = read_folder(tmp_path / "runs", "bon")
    by_idx = {t["idx"]: t for t in traces}
    assert sorted(by_idx) == [0, 1, 2]
    assert by_idx[1]["stop"] == "skipped" and "context cap is 320" in by_idx[1]["skip_reason"]
    assert by_idx[0]["n_steps"] >= 1 and by_idx[2]["n_steps"] >= 1
    assert summary["skipped"] == 1


def test_steps_the_prm_sees_nothing_of_score_lowest_and_are_counted(problems, qwen2_dir, prm_dir, tmp_path):
    prm = blind_prm(prm_dir, tmp_path / "prm", keep="")  # every step tokenises to nothing
    done = kvrescue_run("--bench", str(problems), "--limit", "1", "--method", "kvrescue", "--n", "2", "--base",
                        str(qwen2_dir), "--helper", str(qwen2_dir), "--prm", str(prm), "--synthetic-steps", "8:3",
                        "--out", str(tmp_path / "runs"), *SMALL)
    assert done.returncode == 0, done.stderr.decode()[-3000:]
    (trace,) = read_folder(tmp_path / "runs", "kvrescue")[1]
    scored = [c["score"] for step in trace["candidates"] for c in step if c["score"] is not None]
    assert trace["n_steps"] == 3 and trace["prm_unseen"] == len(scored) >= 6 and set(scored) == {0.0}


def test_an_error_inside_a_cell_is_one_line_naming_it_and_the_finished_problems_resume(monkeypatch, problems, qwen2_dir,
                                                                                        tmp_path):
    from kvrescue.engine.scoring import HelperLoglik

    launch = HelperLoglik.launch  # how the controller asks for scores (read an iteration later)

    def failing(self, requests):  # an unexpected error once the third problem is scored (a fault injected)
        if any(key == 2 for key, _, _ in requests):
            raise IndexError("index -1 is out of bounds")
        return launch(self, requests)

    args = ("--bench", str(problems), "--limit", "4", "--method", "bon", "--n", "2", "--base", str(qwen2_dir),
            "--helper", str(qwen2_dir), "--prm", "helper-loglik", "--out", str(tmp_path / "runs"), *SMALL)
    monkeypatch.setattr(HelperLoglik, "launch", failing)
    done = kvrescue_run(*args)
    last = done.stderr.decode().strip().splitlines()[-1]
    assert done.returncode == 1 and "Traceback" not in done.stderr.decode(), done.stderr.decode()[-3000:]
    assert last.startswith("stopped: tiny bon B=16 N=2 seed=0: IndexError: index -1 is out of bounds, with problem(s) ")
    assert "2" in last.split("problem(s) ")[1].split(" unfinished")[0] and "run the same command again" in last
    kept = {t["idx"] for t in read_folder(tmp_path / "runs", "bon")[1]}
    assert 2 not in kept and f"the {len(kept)} finished are kept" in last
    monkeypatch.setattr(HelperLoglik, "launch", launch)
    ok(kvrescue_run(*args))
    assert sorted(t["idx"] for t in read_folder(tmp_path / "runs", "bon")[1]) == [0, 1, 2, 3]


def test_jsonl_without_the_problem_field_is_a_one_line_error(qwen2_dir, prm_dir, tmp_path):
    path = tmp_path / "odd.jsonl"
    path.write_text('{"text": "What is 2 + 2?", "answer": "4"}\n')
    done = kvrescue_run("--bench", str(path), "--method", "bon", "--base", str(qwen2_dir), "--prm", str(prm_dir),
                        "--out", str(tmp_path), *SMALL)
    assert done.returncode == 2 and b"odd.jsonl:1: no 'problem' or 'question' field" in done.stderr


def test_full_and_helper_never_build_the_evicting_cache(monkeypatch, problems, qwen2_dir, llama_dir, prm_dir, tmp_path):
    from rich.progress import Progress

    from kvrescue.engine import bounded
    from kvrescue.engine.sampling import SamplingParams
    from kvrescue.runs import run_grid
    from kvrescue.search import SearchSettings

    def refuse(*args, **kwargs):
        raise AssertionError("the evicting cache was built")

    monkeypatch.setattr(bounded.BoundedCache, "__init__", refuse)
    settings = SearchSettings(sampling=SamplingParams(temperature=1.0, top_k=0, top_p=1.0), max_step_tokens=12,
                              max_steps=3, context_cap=320, batch=2)
    options = small_grid(tmp_path, settings, benches=[str(problems)], methods=["full", "helper"], limit=2,
                         models={"base": str(qwen2_dir), "helper": str(llama_dir), "prm": str(prm_dir)})
    results = run_grid(options, Progress(disable=True))
    assert [(c.method, s.problems) for c, s in results] == [("full", 2), ("helper", 2)]


def test_a_7b_model_on_a_cpu_is_refused_before_loading(problems, tmp_path):
    folder = tmp_path / "qwen7b"
    folder.mkdir()
    (folder / "config.json").write_text(orjson.dumps({
        "architectures": ["Qwen2ForCausalLM"], "hidden_size": 3584, "intermediate_size": 18944,
        "num_hidden_layers": 28, "num_attention_heads": 28, "num_key_value_heads": 4, "vocab_size": 152064,
        "tie_word_embeddings": False}).decode())  # no weights at all: the refusal must come first
    done = kvrescue_run("--bench", str(problems), "--method", "bon", "--base", str(folder), "--prm", "helper-loglik",
                        "--helper", str(folder), "--out", str(tmp_path), "--device", "cpu")
    assert done.returncode == 2
    assert b"base model" in done.stderr and b"7.6B parameters" in done.stderr and b"--preset cpu-demo" in done.stderr


@pytest.mark.slow
def test_cpu_demo_preset_on_smollm2(tmp_path):
    """The README's main job, shrunk: SmolLM2-135M base and helper with the helper-loglik scorer."""
    # steps of 16 tokens, at most 2 of them: each token is a forward of a 135M model, and nothing below depends on a
    # step's length or count (each step's candidates and score are checked alike, the first step already has them)
    done = kvrescue_run("--preset", "cpu-demo", "--bench", "gsm8k", "--limit", "1",
                        "--method", "kvrescue", "--budget", "16", "--n", "1", "--max-steps", "2",
                        "--max-step-tokens", "16", "--out", str(tmp_path))
    assert done.returncode == 0, done.stderr.decode()[-3000:]
    (folder,) = (tmp_path / "gsm8k").iterdir()
    config = orjson.loads((folder / "config.json").read_bytes())
    (trace,) = [orjson.loads(line) for line in (folder / "traces.jsonl").read_bytes().splitlines()]
    assert config["config"]["scorer"] == "helper-loglik" and b"helper-loglik" in done.stderr
    assert 1 <= trace["n_steps"] <= 2 and trace["output"].strip()
    assert all(len(cands) == 2 and {c["source"] for c in cands} == {"base", "helper"} for cands in trace["candidates"])
    assert all(s["score"] <= 0 for s in trace["steps"])  # mean log-probabilities


def test_cuda_kernel_layouts_give_the_same_traces(grid, problems, qwen2_dir, llama_dir, prm_dir, tmp_path,
                                                 monkeypatch):
    """The same cells with SDPA returning CUDA's output layout (`tests.cuda_layouts`) in the run's process (this
    one: a subprocess would cost its imports): the evicting base's prefill, commits and decode, the full caches and
    the PRM compute the same tokens and scores."""
    from tests import cuda_layouts

    cuda_layouts.install(monkeypatch.setattr)
    ok(kvrescue_run("--bench", str(problems), "--method", "kvrescue,bon", "--n", "2", "--limit", "3",
                    "--base", str(qwen2_dir), "--helper", str(llama_dir), "--prm", str(prm_dir), "--out", str(tmp_path),
                    *SMALL))
    strip = lambda t: {k: v for k, v in t.items() if k != "timings"}  # noqa: E731
    for method in ("kvrescue", "bon"):
        native = sorted(map(strip, read_folder(grid, method)[1]), key=lambda t: t["idx"])
        cuda = sorted(map(strip, read_folder(tmp_path, method)[1]), key=lambda t: t["idx"])
        assert cuda == native, method
