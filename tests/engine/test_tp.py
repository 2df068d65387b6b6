"""Tensor parallelism: two gloo ranks (real subprocesses) compute what one device computes.

The base (Qwen3: q/k norms, head_dim twice hidden / heads, 4/2 heads, vocab 515: the vocab-parallel head pads
its last shard) is sharded over both ranks; the helper (Llama, tied embeddings, 4/1 heads) replicates its single
KV head on both; the PRM (a Qwen2 decoder: q/k/v bias) is sharded with its score head replicated. One workload (tests/tp_scenario.py) runs on each rank
and in this process; fp32 outputs must agree within 1e-5 and the evicting cache must keep the same
positions per layer and KV head.
"""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import orjson

import pytest
import torch

from kvrescue.model_config import ModelArgs
from kvrescue.shapes import local_args, shard_degree
from kvrescue_testkit.random_checkpoints import write_random_checkpoint
from tests import tp_scenario

pytestmark = pytest.mark.waiting  # scripts/test.sh runs it in a process of its own, beside the others

TOL = 1e-5
SHAPE = dict(hidden_size=64, num_layers=2, intermediate_size=128, init_std=0.1)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> list[Path]:
    tmp = tmp_path_factory.mktemp("tp")
    return [
        write_random_checkpoint(tmp / "base", "qwen3", num_heads=4, num_kv_heads=2, vocab_size=515, seed=11, **SHAPE),
        write_random_checkpoint(tmp / "helper", "llama", num_heads=4, num_kv_heads=1, seed=12, **SHAPE),
        write_random_checkpoint(tmp / "prm", "prm", num_heads=4, num_kv_heads=2, seed=13, **SHAPE),
    ]


@pytest.fixture(scope="module")
def results(checkpoints, tmp_path_factory) -> tuple[dict, list[dict]]:
    """(one device's outputs, each of two ranks' outputs)."""
    tmp = tmp_path_factory.mktemp("tp_run")
    procs = [
        subprocess.Popen([sys.executable, "-m", "tests.tp_scenario", str(rank), "2", str(tmp / "rendezvous"),
                          str(tmp / f"rank{rank}.pt"), *map(str, checkpoints)], cwd=ROOT, stderr=subprocess.PIPE)
        for rank in range(2)
    ]
    single = tp_scenario.run(*checkpoints)
    for p in procs:
        _, err = p.communicate(timeout=300)
        assert p.returncode == 0, err.decode()[-3000:]
    return single, [torch.load(tmp / f"rank{rank}.pt", weights_only=False) for rank in range(2)]


def _close(a, b) -> None:
    for x, y in zip(a, b, strict=True):
        assert x.shape == y.shape and (x - y).abs().max().item() < TOL


@pytest.mark.parametrize("key", ["full", "bounded", "static", "helper"])
def test_cached_prefill_and_decode_logits_equal_one_device(results, key) -> None:
    """The full cache, the evicting cache (dynamic and static decode step), the helper's replicated KV head."""
    single, ranks = results
    for rank in ranks:
        _close(rank[key], single[key])


def test_plain_logits_and_prm_scores_equal_one_device(results) -> None:
    single, ranks = results
    for rank in ranks:
        _close([rank["plain"]], [single["plain"]])
        _close(torch.tensor(rank["prm_plain"] + rank["prm_cached"]), torch.tensor(single["prm_plain"] + single["prm_cached"]))


@pytest.mark.parametrize("key", ["kept", "kept_h2o"])
def test_each_rank_keeps_the_positions_one_device_keeps_for_its_kv_heads(results, key) -> None:
    """Every compression, every layer and row: rank r's KV head equals one device's head r (rkv, and h2o)."""
    single, ranks = results
    assert len(single[key]) >= 3
    for r, rank in enumerate(ranks):
        for mine, whole in zip(rank[key], single[key], strict=True):
            assert whole.shape[2] == 2 and mine.shape[2] == 1
            assert torch.equal(mine, whole[:, :, r : r + 1])


def test_each_model_is_split_as_planned(results) -> None:
    """(query heads, KV heads, ranks per copy) each rank computes: helper's one KV head is on both."""
    assert results[1][0]["shapes"] == {"base": (2, 1, 2), "helper": (2, 1, 2), "prm": (2, 1, 2)}
    assert results[0]["shapes"] == {"base": (4, 2, 1), "helper": (4, 1, 1), "prm": (4, 2, 1)}
    # each rank holds little more than half (norms, the PRM head and the helper's KV head are whole)
    assert results[1][0]["parameters"] < 0.6 * results[0]["parameters"]


def test_shard_degrees_of_the_papers_setting() -> None:
    """K = 8: the 72B base 8 ways, the 7B PRM (28/4) 4 ways, the 1.5B helper (12/2) 4 ways, its KV heads on 2 ranks each."""
    assert shard_degree(64, 8, 29568, 8, exact_heads=True) == 8
    assert shard_degree(28, 4, 18944, 8) == 4 and shard_degree(12, 2, 8960, 8) == 4
    helper = ModelArgs(vocab_size=151936, dim=1536, intermediate_size=8960, n_layers=28, n_heads=12, n_kv_heads=2,
                       head_dim=128)
    assert (local_args(helper, 4).n_heads, local_args(helper, 4).n_kv_heads) == (3, 1)
    assert shard_degree(7, 7, 700, 8) == 1  # nothing divides: a whole copy per rank
    with pytest.raises(ValueError, match="--tp 8 must divide the base's 28 query heads, 4 KV heads"):
        shard_degree(28, 4, 18944, 8, exact_heads=True)


def test_tp_check_tiny_runs_on_two_cpu_ranks(tmp_path):
    """benchmarks/gpu_check/tp_check.py (gpu_check's `tp` section) end to end over gloo: fp32 logits agree, both rates measured."""
    out = tmp_path / "tp.json"
    done = benchmark("gpu_check/tp_check.py", "--tiny", "--out", str(out), capture_output=True, timeout=600)
    assert done.returncode == 0, done.stderr.decode()[-3000:]
    report = json.loads(out.read_text())
    assert report["logits"]["max_abs"] < TOL and report["logits"]["top1_agreement"] == 1.0
    assert report["tp1"]["eager"] > 0 and report["tp2"]["eager"] > 0
    assert "tp=2 vs 1 (tiny): logits max|d|=" in done.stdout.decode()


def test_tp_without_a_process_group_is_a_load_error(checkpoints):
    from kvrescue.engine.loader import ModelLoadError, load_model

    with pytest.raises(ModelLoadError, match="--tp 2 needs torch.distributed initialised with 2 ranks"):
        load_model(checkpoints[0], tp=2, exact_heads=True)


# -- whole runs: `--devices cpu,cpu --tp 2` is one group of two ranks ------------------------------------
from tests.helpers import ROOT, RUN_WAIT_S, benchmark, kvrescue, small_cell, small_grid, sums, traces_of  # noqa: E402
from tests.test_workers import command, comparable, descendants, models, problems  # noqa: E402,F401

METHODS = ["--method", "kvrescue,bon,full", "--dtype", "float32"]  # exact up to float rounding in fp32


def _run_traces(out: Path) -> dict[str, list[dict]]:
    return {path.parent.name.split("-")[0]: [orjson.loads(line) for line in path.read_bytes().splitlines()]
            for path in out.glob("tiny/*/traces.jsonl")}


@pytest.fixture(scope="module")
def one_device(tmp_path_factory, problems, models) -> dict[str, list[dict]]:
    out = tmp_path_factory.mktemp("one")
    done = kvrescue(*command(problems, models, out, *METHODS, "--devices", "cpu")[1:])
    assert done.returncode == 0, done.stderr.decode()[-3000:]
    return _run_traces(out)


def test_a_run_over_two_ranks_writes_what_one_device_writes(one_device, problems, models, tmp_path) -> None:
    # rank 0 in this process (a `kvrescue run` process's part), rank 1 the subprocess it starts
    done = kvrescue(*command(problems, models, tmp_path, *METHODS, "--devices", "cpu,cpu", "--tp", "2")[1:])
    assert done.returncode == 0, done.stderr.decode()[-3000:]
    two = _run_traces(tmp_path)
    assert sorted(two) == ["bon", "full", "kvrescue"]
    for method, traces in one_device.items():
        assert comparable(two[method]) == comparable(traces, approx=True), method
    (config,) = tmp_path.glob("tiny/kvrescue-*/config.json")
    assert orjson.loads(config.read_bytes())["environment"]["executor"] == {
        "kind": "in-process", "devices": ["cpu", "cpu"], "tp": 2}


def test_tp_options_that_cannot_run_are_one_line_errors(problems, models, tmp_path) -> None:
    for args, message in ((["--devices", "cpu,cpu,cpu", "--tp", "2"], "--tp 2 does not divide the 3 devices"),
                          (["--devices", "cpu,cpu,cpu,cpu", "--tp", "4"], "--tp 4 must divide the base's 4 query heads, 2 KV heads")):
        done = kvrescue(*command(problems, models, tmp_path, *args)[1:])
        assert done.returncode == 2 and message.encode() in done.stderr, done.stderr.decode()[-2000:]
        assert not list(tmp_path.glob("tiny/*"))  # nothing loaded, no run folder


def test_a_killed_rank_fails_its_group_which_is_restarted(one_device, problems, models, cluster, tmp_path) -> None:
    """One group of two ranks as a Ray actor (rank 0) and its child (rank 1): SIGKILL rank 1 after the first
    trace, with problems still to do (the four of `problems` first, then two more)."""
    more = tmp_path / "tiny.jsonl"
    extra = [{"question": f"What is {a} + {a}? Let x be the answer.", "answer": str(2 * a)} for a in range(10, 12)]
    more.write_bytes(problems.read_bytes() + b"".join(orjson.dumps(r) + b"\n" for r in extra))
    out = tmp_path / "out"
    process = subprocess.Popen(command(more, models, out, "--devices", "cpu,cpu", "--tp", "2", "--dtype", "float32",
                                       "--ray-address", cluster.address, "--batch", "1"),
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.time() + RUN_WAIT_S
    while not any(path.read_bytes() for path in out.glob("tiny/*/traces.jsonl")):
        assert time.time() < deadline and process.poll() is None, "no trace written"
        time.sleep(0.05)
    ((follower, folder),) = followers().items()
    os.kill(follower, signal.SIGKILL)
    folders = {folder}
    while process.poll() is None:  # the restarted group's folder too
        folders |= set(followers().values())
        assert time.time() < deadline, "the run did not end"
        time.sleep(0.05)
    _, err = process.communicate(timeout=RUN_WAIT_S)
    err = err.decode()
    assert len(folders) == 2 and all(f.name.startswith("kvrescue-tp-") for f in folders), folders
    removed_by = time.time() + 30  # by the crashed actor, then by the last one as the driver ends
    while any(f.exists() for f in folders):
        assert time.time() < removed_by, f"left behind: {[f for f in folders if f.exists()]}"
        time.sleep(0.05)
    assert process.returncode == 0, err[-3000:]
    assert "died" in err and "starting a new worker for its group" in err, err[-3000:]
    assert f"rank 1 (pid {follower}) was killed by signal 9" in err, err[-3000:]  # the group's error says why
    traces = comparable(traces_of(out))
    assert [t["idx"] for t in traces] == list(range(6))  # each problem exactly once
    assert traces[:4] == comparable(one_device["kvrescue"], approx=True)


def followers() -> dict[int, Path]:
    """Each live rank > 0 (`kvrescue.rank_follower`) below this process, and its group's folder."""
    found = {}
    for pid in descendants(os.getpid()):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except (FileNotFoundError, ProcessLookupError):  # gone meanwhile
            continue
        if b"kvrescue.rank_follower" in argv:
            found[pid] = Path(argv[argv.index(b"kvrescue.rank_follower") + 1].decode())
    return found


def test_a_group_that_cannot_form_leaves_no_folder(monkeypatch, tmp_path) -> None:
    import tempfile
    import threading

    from kvrescue.rank_group import RankGroup

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    with pytest.raises(TypeError, match="pickle"):
        RankGroup(threading.Lock(), ("cpu", "cpu"))  # options that cannot be handed to the other ranks
    assert list(tmp_path.iterdir()) == []


def test_the_other_ranks_wait_between_cells_as_long_as_rank_0_lives(models, monkeypatch, tmp_path) -> None:
    """With collectives timing out after 10 s, rank 0 waits 25 s between two cells (as a Ray actor waits for the
    slowest actor of a grid): rank 1 is still there for the second cell, and exits when told to."""
    from datetime import timedelta

    from kvrescue import in_process, rank_group
    from kvrescue.search import SearchSettings

    monkeypatch.setenv("KVRESCUE_TP_TIMEOUT_S", "10")  # rank 1's (it reads it when it starts)
    monkeypatch.setattr(rank_group, "TIMEOUT", timedelta(seconds=10))
    roles = dict(zip(("base", "helper", "prm"), models[1::2]))
    options = small_grid(tmp_path, SearchSettings(batch=1, synthetic_steps=(4, 2), max_step_tokens=8, context_cap=256),
                         models=roles, devices=("cpu", "cpu"), tp=2)
    problems = sums(2)
    cell = small_cell(problems)
    traces = []
    group = in_process.InProcessGroup(options, ("cpu", "cpu"))
    try:
        group.decode_cell(cell, problems[:1], lambda trace, tokens: traces.append(trace))
        time.sleep(25)
        assert group.ranks.followers[0].poll() is None, "rank 1 is gone"
        group.decode_cell(cell, problems[1:], lambda trace, tokens: traces.append(trace))
    finally:
        group.close()
    assert [t.idx for t in traces] == [0, 1] and all(t.n_steps == 2 for t in traces)
    assert group.ranks.followers[0].returncode == 0
    assert not group.ranks.folder.exists()  # a normal close removes the group's folder


def test_a_rank_that_fails_is_named_in_the_groups_error_with_its_status_and_last_stderr_lines(models, tmp_path) -> None:
    """Rank 1 fails on a message it cannot decode (a traceback, status 1): the next cell of the in-process group
    raises RankGone saying so, and closing the group does not raise over it."""
    from kvrescue import in_process
    from kvrescue.rank_group import RankGone
    from kvrescue.search import SearchSettings

    roles = dict(zip(("base", "helper", "prm"), models[1::2]))
    options = small_grid(tmp_path, SearchSettings(batch=1, synthetic_steps=(4, 2), max_step_tokens=8, context_cap=256),
                         models=roles, devices=("cpu", "cpu"), tp=2)
    problems = sums(1)
    group = in_process.InProcessGroup(options, ("cpu", "cpu"))
    try:
        group.ranks._send(("cell", None))  # rank 1 cannot plan a cell of None
        assert group.ranks.followers[0].wait(timeout=RUN_WAIT_S) == 1
        with pytest.raises(RankGone, match=r"^rank 1 \(pid \d+\) exited with status 1, its stderr ending: .*"
                                           r"AttributeError: 'NoneType' object .*\(rank 0 then raised BrokenPipeError"):
            group.decode_cell(small_cell(problems), problems, lambda trace, tokens: None)
    finally:
        group.close()


def test_every_rank_takes_rank_0s_decisions_where_copies_of_a_model_disagree(checkpoints, tmp_path) -> None:
    """The helper held whole on each of 2 ranks (3 heads), the base sharded: rank 1's helper logits and PRM
    scores are moved by noise (tests/tp_decisions.py); both ranks still sample, finish and commit alike."""
    import pickle

    from kvrescue.engine.sampling import SamplingParams
    from kvrescue.search import SearchSettings

    helper = write_random_checkpoint(tmp_path / "helper3", "llama", num_heads=3, num_kv_heads=1, seed=14,
                                     hidden_size=48, num_layers=2, intermediate_size=128, init_std=0.1)
    assert shard_degree(3, 1, 128, 2) == 1
    settings = SearchSettings(sampling=SamplingParams(temperature=1.0, top_k=0, top_p=1.0), max_step_tokens=10,
                              max_steps=4, context_cap=256, batch=2)
    options = small_grid(tmp_path, settings, methods=["kvrescue"], devices=("cpu", "cpu"), tp=2,
                         models={"base": str(checkpoints[0]), "helper": str(helper), "prm": str(checkpoints[2])})
    problems = sums(3, plus=2, text=" Let x be the answer.")
    setup = tmp_path / "setup.pickle"
    setup.write_bytes(pickle.dumps((options, small_cell(problems, "kvrescue"))))
    procs = [subprocess.Popen([sys.executable, "-m", "tests.tp_decisions", str(rank), "2", str(tmp_path / "rendezvous"),
                               str(setup), str(tmp_path / f"rank{rank}.json")], cwd=ROOT, stderr=subprocess.PIPE)
             for rank in range(2)]
    for p in procs:
        _, err = p.communicate(timeout=300)
        assert p.returncode == 0, err.decode()[-3000:]
    ranks = [orjson.loads((tmp_path / f"rank{rank}.json").read_bytes()) for rank in range(2)]
    assert [t["idx"] for t in ranks[0]] == [0, 1, 2]
    assert any(c[0] == "helper" for t in ranks[0] for cands in t["candidates"] for c in cands)
    assert ranks[1] == ranks[0]
