"""Ray actors over device groups (`--devices cpu,cpu`, a two-node local cluster), crash safety, Ctrl-C, and
`--shard` merged by the report."""

import os
import re
import signal
import subprocess
import time
from collections import deque
from pathlib import Path

import orjson
import pytest

from kvrescue.data import Problem
from kvrescue.devices import resolve_devices
from kvrescue.errors import InputError
from kvrescue.work_queue import WorkQueue
from tests.helpers import KVRESCUE, PAIRS, RUN_WAIT_S, kvrescue, small_cell, small_grid, tiny_problems, traces_of

pytestmark = pytest.mark.waiting  # scripts/test.sh runs it in a process of its own, beside the others

MANY = 20  # problems of `many_problems`
# `--batch 1`: each problem decodes alone, so its traces do not depend on which problems a worker happens to
# batch together (a batch's shape moves a row's logits in their last bits: docs/reproducibility.md)
SMALL = ["--method", "kvrescue", "--n", "2", "--max-step-tokens", "12", "--max-steps", "5", "--context-cap", "320",
         "--budget", "16", "--temperature", "1.0", "--top-k", "0", "--top-p", "1.0", "--batch", "1"]


def problem(idx: int) -> Problem:
    return Problem(idx, f"p{idx}", "1", {})


@pytest.mark.parametrize("gpus", [0, 2])
def test_devices_resolve_against_the_visible_gpus(monkeypatch, gpus):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpus > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    assert resolve_devices("auto") == (("cuda:0", "cuda:1") if gpus else ("cpu",))
    assert resolve_devices("cpu,cpu") == ("cpu", "cpu")
    if gpus:
        assert resolve_devices("cuda") == ("cuda:0",) and resolve_devices("cuda:1,cpu") == ("cuda:1", "cpu")
    for bad in ("tpu", "cuda:2", "cuda:x", "", *(() if gpus else ("cuda",))):
        with pytest.raises(InputError):
            resolve_devices(bad)


@pytest.fixture(scope="module")
def problems(tmp_path_factory) -> Path:
    return tiny_problems(tmp_path_factory.mktemp("data") / "tiny.jsonl", PAIRS[:4])


@pytest.fixture(scope="module")
def many_problems(tmp_path_factory, problems) -> Path:
    """`problems` followed by more, MANY in all: a run on two actors that is still going when its first trace is
    written."""
    path = tmp_path_factory.mktemp("many") / "tiny.jsonl"
    more = [{"question": f"What is {a} + 1? Let x be the answer.", "answer": str(a + 1)} for a in range(10, 6 + MANY)]
    path.write_bytes(problems.read_bytes() + b"".join(orjson.dumps(r) + b"\n" for r in more))
    return path


@pytest.fixture(scope="module")
def models(qwen2_dir, llama_dir, prm_dir) -> list[str]:
    return ["--base", str(qwen2_dir), "--helper", str(llama_dir), "--prm", str(prm_dir)]


def command(problems: Path, models: list[str], out: Path, *args: str) -> list[str]:
    return [KVRESCUE, "run", "--bench", str(problems), *models, *SMALL, "--out", str(out), *args]


def comparable(traces: list[dict], approx: bool = False) -> list[dict]:
    """Traces by idx without timings; with `approx`, scores as approximations: the PRM's batch composition
    (which problems share a forward) moves the last float bits of a score, nothing else."""
    def score(x: float | None):
        return pytest.approx(x, abs=1e-5) if approx and x is not None else x

    def strip(trace: dict) -> dict:
        trace = {k: v for k, v in trace.items() if k != "timings"}
        trace["steps"] = [{**s, "score": score(s["score"])} for s in trace["steps"]]
        trace["candidates"] = [[{**c, "score": score(c["score"])} for c in cands] for cands in trace["candidates"]]
        return trace
    return sorted(map(strip, traces), key=lambda t: t["idx"])


@pytest.fixture(scope="module")
def reference(tmp_path_factory, problems, models) -> list[dict]:
    """The run in this process on one device."""
    out = tmp_path_factory.mktemp("one")
    done = kvrescue(*command(problems, models, out, "--devices", "cpu")[1:])
    assert done.returncode == 0, done.stderr.decode()[-3000:]
    return traces_of(out)


def descendants(root: int) -> list[int]:
    """Every live process below `root`."""
    found, todo = [], [root]
    while todo:
        for task in Path(f"/proc/{todo.pop()}/task").glob("*"):
            try:
                children = [int(pid) for pid in (task / "children").read_text().split()]
            except FileNotFoundError:
                continue
            found += children
            todo += children
    return found


def alive(pid: int) -> bool:
    try:
        return b"State:\tZ" not in Path(f"/proc/{pid}/status").read_bytes()
    except FileNotFoundError:
        return False


def actor_pids(root: int) -> list[int]:
    """The GroupWorker actor processes below `root` (the Ray nodes it started, and their workers)."""
    found = []
    for pid in descendants(root):
        try:
            if Path(f"/proc/{pid}/cmdline").read_bytes().startswith(b"ray::GroupWorker"):
                found.append(pid)
        except FileNotFoundError:
            pass
    return found


def wait_for_traces(out: Path, process: subprocess.Popen, lines: int) -> bytes:
    deadline = time.time() + RUN_WAIT_S
    while time.time() < deadline and process.poll() is None:
        found = list(out.glob("tiny/*/traces.jsonl"))
        if found and found[0].read_bytes().count(b"\n") >= lines:
            return found[0].read_bytes()
        time.sleep(0.05)
    raise AssertionError("the run wrote no trace before the deadline")


def test_two_actors_on_two_nodes_survive_a_sigkill_and_give_the_in_process_traces(many_problems, models, reference,
                                                                                  cluster, tmp_path):
    # one problem in flight per actor: problems are still left when the first trace is written
    process = subprocess.Popen(command(many_problems, models, tmp_path, "--devices", "cpu,cpu", "--ray-address",
                                       cluster.address), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    written = wait_for_traces(tmp_path, process, 1)
    victims = actor_pids(os.getpid())
    assert len(victims) == 2
    os.kill(victims[0], signal.SIGKILL)
    out, err = process.communicate(timeout=RUN_WAIT_S)
    assert process.returncode == 0, err.decode()[-3000:]
    err = err.decode()
    assert f"pid {victims[0]}) died (The actor is dead" in err and "last problem given:" in err, err[-3000:]
    traces = traces_of(tmp_path)
    (path,) = tmp_path.glob("tiny/kvrescue-*/traces.jsonl")
    assert path.read_bytes().startswith(written[: written.rfind(b"\n") + 1])  # nothing written before is lost
    assert sorted(t["idx"] for t in traces) == list(range(MANY))  # every problem exactly once
    assert comparable([t for t in traces if t["idx"] < 4]) == comparable(reference, approx=True)
    assert orjson.loads(next(tmp_path.glob("tiny/kvrescue-*/summary.json")).read_bytes())["complete"]
    executor = orjson.loads(next(tmp_path.glob("tiny/kvrescue-*/config.json")).read_bytes())["environment"]["executor"]
    assert executor["kind"] == "ray" and executor["nodes"] == 2 and executor["address"] == cluster.address
    assert len({worker["node_id"] for worker in executor["workers"]}) == 2  # one actor on each node
    assert sorted(worker["pid"] for worker in executor["workers"]) == sorted(victims)


def test_a_lost_node_costs_only_its_actor_and_the_others_finish_the_run(problems, models, cluster, tmp_path):
    doomed = cluster.add_node(num_cpus=1, object_store_memory=80 * 2**20)
    cluster.wait_for_nodes()
    # one problem in flight per actor, and longer problems: the doomed actor holds one when its node goes
    process = subprocess.Popen(command(problems, models, tmp_path, "--devices", "cpu,cpu,cpu", "--ray-address",
                                       cluster.address, "--max-steps", "20"),
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.time() + RUN_WAIT_S
    while not list(tmp_path.glob("tiny/kvrescue-*/config.json")) and process.poll() is None and time.time() < deadline:
        time.sleep(0.05)  # config.json is written once every actor is ready, as the cell starts
    executor = orjson.loads(next(tmp_path.glob("tiny/kvrescue-*/config.json")).read_bytes())["environment"]["executor"]
    (lost,) = [worker for worker in executor["workers"] if worker["node_id"] == doomed.node_id]
    cluster.remove_node(doomed, allow_graceful=False)  # its actor's replacement finds no free CPU
    _, err = process.communicate(timeout=RUN_WAIT_S)
    assert process.returncode == 0, err.decode()[-3000:]
    assert f"({lost['node_id'][:8]}), pid {lost['pid']}) died (" in err.decode(), err.decode()[-3000:]
    assert sorted(t["idx"] for t in traces_of(tmp_path)) == list(range(4))  # every problem exactly once
    assert orjson.loads(next(tmp_path.glob("tiny/kvrescue-*/summary.json")).read_bytes())["complete"]


def test_ctrl_c_stops_every_actor_and_the_private_ray_instance_and_the_run_resumes(many_problems, models, reference,
                                                                                   tmp_path):
    product_default = {k: v for k, v in os.environ.items() if k != "RAY_worker_niceness"}  # conftest sets 0
    process = subprocess.Popen(command(many_problems, models, tmp_path, "--devices", "cpu,cpu"), env=product_default,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    deadline = time.time() + RUN_WAIT_S  # both actors up (Ray renames an actor's process once it exists), then a trace
    while time.time() < deadline and process.poll() is None and len(actor_pids(process.pid)) < 2:
        time.sleep(0.05)
    assert len(actor_pids(process.pid)) == 2, process.poll()
    assert [os.getpriority(os.PRIO_PROCESS, pid) for pid in actor_pids(process.pid)] == [0, 0]  # not Ray's 15
    wait_for_traces(tmp_path, process, 1)
    ray_processes = descendants(process.pid)  # the private Ray instance's node and its actors
    os.killpg(process.pid, signal.SIGINT)  # what a terminal's Ctrl-C does: the whole process group
    _, err = process.communicate(timeout=120)
    assert process.returncode == 130, err.decode()[-3000:]
    assert b"run the same command again to resume" in err
    interrupted = traces_of(tmp_path)
    assert 0 < len(interrupted) < MANY
    deadline = time.time() + 30  # Ray's shutdown ends its processes; the kernel may take a moment to reap
    while time.time() < deadline and any(alive(pid) for pid in ray_processes):
        time.sleep(0.1)
    assert not [pid for pid in ray_processes if alive(pid)]
    done = kvrescue(*command(many_problems, models, tmp_path, "--devices", "cpu")[1:])  # the resume, in this process
    assert done.returncode == 0, done.stderr.decode()[-3000:]
    resumed = traces_of(tmp_path)
    assert sorted(t["idx"] for t in resumed) == list(range(MANY))
    assert comparable([t for t in resumed if t["idx"] < 4]) == comparable(reference, approx=True)
    executor = orjson.loads(next(tmp_path.glob("tiny/kvrescue-*/config.json")).read_bytes())["environment"]["executor"]
    assert executor == {"kind": "in-process", "devices": ["cpu"]}


def test_shards_split_the_problems_and_the_report_merges_them(problems, models, reference, tmp_path):
    for i in range(2):
        done = kvrescue(*command(problems, models, tmp_path / f"node{i}", "--devices", "cpu", "--shard", f"{i}/2")[1:])
        assert done.returncode == 0, done.stderr.decode()[-3000:]
        assert sorted(t["idx"] for t in traces_of(tmp_path / f"node{i}")) == list(range(i, 4, 2))
    (a,), (b,) = [list((tmp_path / f"node{i}" / "tiny").iterdir()) for i in range(2)]
    assert a.name == b.name  # the shard is not part of the run's identity
    report = kvrescue("report", str(tmp_path / "node0"), str(tmp_path / "node1"), "--format", "json")
    assert report.returncode == 0, report.stderr.decode()[-3000:]
    data = orjson.loads(report.stdout)
    (runs,) = [t for t in data["tables"] if t["name"] == "runs"]
    (row,) = runs["rows"]
    assert row[runs["columns"].index("problems")] == "4/4" and row[-1] == "done"
    assert any("merged 2 of 2 shards" in p["message"] for p in data["problems"])
    merged = comparable(traces_of(tmp_path / "node0") + traces_of(tmp_path / "node1"))
    assert merged == comparable(reference, approx=True)
    partial = kvrescue("report", str(tmp_path / "node0"), "--format", "json")
    assert b"shards 1/2 missing" in partial.stdout


def test_a_rerun_of_a_complete_grid_over_two_device_groups_starts_no_ray_instance(problems, models, monkeypatch,
                                                                                  tmp_path):
    """Every cell complete, a run over `--devices cpu,cpu` (Ray actors) only summarises: it starts no Ray instance
    (one started now would fail the run) and prints the table of the run that decoded the cells in this process."""
    import ray

    first = kvrescue(*command(problems, models, tmp_path, "--devices", "cpu", "--limit", "2")[1:])
    assert first.returncode == 0, first.stderr.decode()[-3000:]

    def no_ray(*args, **kwargs):
        raise RuntimeError("a Ray instance was started")

    monkeypatch.setattr(ray, "init", no_ray)
    again = kvrescue(*command(problems, models, tmp_path, "--devices", "cpu,cpu", "--limit", "2")[1:])
    assert again.returncode == 0, again.stderr.decode()[-3000:]
    table = lambda done: [line for line in re.split(rb"kvrescue run *\n", done.stderr)[-1].splitlines()  # noqa: E731
                          if b"seed=" in line]
    assert table(again) == table(first) and len(table(first)) == 1


def test_a_problem_that_kills_two_actors_is_recorded_as_failed_and_no_actor_left_stops_the_run(models, cluster,
                                                                                              tmp_path):
    import ray

    from kvrescue import workers
    from kvrescue.outputs import RunConfig, summarize
    from kvrescue.search import SearchSettings

    roles = dict(zip(("base", "helper", "prm"), models[1::2]))
    options = small_grid(tmp_path, SearchSettings(batch=8), models=roles, ray_address=cluster.address)
    cell = small_cell()
    said, emitted = [], []
    ray.init(address=cluster.address, **workers.RAY_QUIET)
    try:
        pool = workers.RayWorkers(options, said.append)
        pool.start()
        (worker,) = pool.workers
        pool.deaths[0] = workers.GROUP_RESTARTS - 1  # this death is the group's last: no new actor
        queue = WorkQueue(deque([problem(7)]))
        queue.take(5)
        queue.lost(5, "killed by SIGKILL")  # its first death, in another actor
        assert queue.take(worker.number).idx == 7
        worker.state = "running"
        ray.kill(worker.actor)  # its exchange in flight fails
        pool._wait(queue, cell, lambda trace, tokens: emitted.append(trace))
    finally:
        ray.shutdown()
    (trace,) = emitted
    assert trace.idx == 7 and trace.stop == "failed"
    assert trace.skip_reason.startswith("killed 2 workers: killed by SIGKILL; The actor is dead because it was "
                                        "killed by `ray.kill`")
    assert any(f"pid {worker.placement['pid']}) died (The actor is dead" in s and "holding problems [7]" in s
               and "no new worker" in s for s in said)
    config = RunConfig("t", "bon", 16, 2, "rkv", 0, {}, "prm")
    assert summarize(emitted, config).failed == 1
    with pytest.raises(workers.WorkersGone, match="every worker is gone .group 0: The actor is dead.*; 1 problems"):
        pool.decode_cell(cell, [problem(8)], lambda trace, tokens: None)


def test_a_model_the_actors_cannot_load_or_a_cluster_without_gpus_is_a_one_line_error_before_any_run_folder(
        problems, models, cluster, tmp_path):
    args = [a if a != models[1] else str(tmp_path / "no-such-model") for a in models]
    done = subprocess.run(command(problems, args, tmp_path / "runs", "--devices", "cpu,cpu", "--ray-address",
                                  cluster.address), capture_output=True, timeout=300)
    assert done.returncode == 2 and b"base model" in done.stderr and b"Traceback" not in done.stderr
    done = subprocess.run(command(problems, models, tmp_path / "runs", "--ray-address", cluster.address),
                          capture_output=True, timeout=300)
    assert done.returncode == 2 and b"the cluster offers no GPU" in done.stderr and b"Traceback" not in done.stderr
    assert not (tmp_path / "runs").exists()


def test_actors_report_their_running_totals_to_the_driver(models, cluster, tmp_path):
    import ray

    from kvrescue import workers
    from kvrescue.search import SearchSettings

    roles = dict(zip(("base", "helper", "prm"), models[1::2]))
    settings = SearchSettings(batch=1, synthetic_steps=(32, 16), max_step_tokens=32, context_cap=2048)
    options = small_grid(tmp_path, settings, models=roles, ray_address=cluster.address)
    cell = small_cell()
    emitted, reported = [], []
    # The actors report every iteration (their processes read the interval from this job's environment), so the
    # test does not depend on how long the decode takes here.
    ray.init(address=cluster.address, runtime_env={"env_vars": {"KVRESCUE_PROGRESS_EVERY_S": "0"}}, **workers.RAY_QUIET)
    try:
        pool = workers.RayWorkers(options, lambda message: None)
        pool.start()
        pool.decode_cell(cell, [problem(1), problem(2)], lambda trace, tokens: emitted.append((trace, tokens)),
                    reported.append)
    finally:
        ray.shutdown()
    assert sorted(trace.idx for trace, _ in emitted) == [1, 2]
    assert len(reported) > 1, "no report from the actors while they decoded"
    assert all(earlier.generated_tokens <= later.generated_tokens for earlier, later in zip(reported, reported[1:]))
    assert 0 < reported[-1].generated_tokens <= sum(tokens for _, tokens in emitted) == 2 * 2 * 32 * 16
    assert reported[-1].committed_steps <= 2 * 16
