"""`benchmarks/gpu_check/gpu_check.py --tiny`: the one-call GPU check runs end to end on the CPU with tiny shapes,
its roofline arithmetic is right, and its time budget bounds every section."""

import importlib
import json
import os
import signal
import sys
import time
from pathlib import Path

import pytest
import torch
from torch.cuda._utils import _get_device_index

from tests.helpers import benchmark, unset_allocator_settings

# The tiny shape's engine in fp32, counted here from its config: embeddings + untied head + 2 layers + final norm.
H, KV, INTER, VOCAB, LAYERS = 64, 32, 128, 1024, 2
TINY_WEIGHT_BYTES = 4 * (2 * VOCAB * H + LAYERS * (H * H + H + 2 * (H * KV + KV) + H * H + 3 * H * INTER + 2 * H) + H)
TINY_ENTRY_BYTES = 2 * LAYERS * KV * 4  # K and V of one token, all layers, fp32


def gpu_check(tmp_path: Path, *args: str, timeout: float = 600) -> tuple[dict, list[str]]:
    out = tmp_path / "check.json"
    done = benchmark("gpu_check/gpu_check.py", "--tiny", "--out", str(out), *args, capture_output=True, timeout=timeout)
    assert done.returncode == 0, done.stderr.decode()[-3000:]
    return json.loads(out.read_text()), done.stdout.decode().splitlines()


@pytest.fixture(scope="module")
def tiny_check(tmp_path_factory) -> tuple[dict, list[str]]:
    """One whole `--tiny` check, every section, read by the tests of its sections (a check costs a process and
    each section's subprocesses: run once, not once per test)."""
    return gpu_check(tmp_path_factory.mktemp("tiny_check"), "--budget-s", "600")


def test_gpu_check_tiny_runs_end_to_end(tiny_check):
    report, lines = tiny_check  # its e2e section: the test below
    bandwidth = report["roofline"]["bytes_per_s"]
    assert report["tiny"] and bandwidth == 2 * report["roofline"]["bytes"] / report["roofline"]["seconds"]
    logits = report["logits"]
    assert logits["ok"], logits
    assert logits["prefill_then_decode"]["top1_agreement"] == 1.0
    (attention,) = report["attention"]  # benchmarks/speed/attention_bench.py at a tiny shape, one layer
    assert all(attention[v]["kv_bytes_read"] > 0 for v in ("gather", "paged", "cascade"))
    assert attention["cascade"]["kv_bytes_read"] < attention["paged"]["kv_bytes_read"]
    model = attention["model"]  # the cascade cost model's times and choice beside the measured faster of the two
    assert model["picks"] in ("paged", "cascade") and model["measured_faster"] in ("paged", "cascade")
    assert model["paged_ms"] > 0 and model["cascade_ms"] > 0
    measured = [d for d in report["decode"] if "skipped" not in d]
    assert {d["engine"] for d in measured} == {"kvrescue", "transformers-generate"}
    flex = report["flex"]  # FlexAttention (eager on a CPU) vs SDPA: both caches, eager and static steps, then forwards
    assert [(f["evictor"], f["step"]) for f in flex] == [(e, s) for e in ("rkv", "none") for s in ("eager", "static")] \
        + [("none", "forward")]  # of several tokens a row over cached keys
    assert all(f["top1_agreement"] == 1.0 and f["max_abs"] < 1e-4 and f["flex_tokens_per_s"] > 0 for f in flex)
    assert {d["evictor"] for d in measured} == {"rkv", "none"}
    assert len(measured) == 2 * 2 * 3  # rows x contexts x (rkv, none, generate)
    flop_rate = report["roofline"]["matmul_flop_per_s"]
    assert report["roofline"]["matmul_dtype"] == "float32" and flop_rate > 0
    for d in measured:  # every step reads the weights and each row's mean cache once, and computes each row's token
        steps = 4
        mean_read = d["context"] + steps / 2 if d["evictor"] == "none" else d["budget"] + 64
        assert d["step_bytes"] == TINY_WEIGHT_BYTES + d["rows"] * mean_read * TINY_ENTRY_BYTES
        assert d["token_flops"] == 2 * (LAYERS * (H * (H + 2 * KV) + H * H + 3 * H * INTER) + VOCAB * H) \
            + 4 * LAYERS * H * mean_read
        memory_s, compute_s = d["step_bytes"] / bandwidth, d["rows"] * d["token_flops"] / flop_rate
        assert d["roofline_tokens_per_s"] == pytest.approx(d["rows"] / max(memory_s, compute_s))
        assert d["bound_by"] == ("memory" if memory_s >= compute_s else "compute")
        assert d["of_roofline"] == pytest.approx(d["tokens_per_s"] / d["roofline_tokens_per_s"])
    assert all(d["skipped"] == "CUDA graphs need a GPU" for d in report["decode"] if d["cuda_graphs"])
    (invariance,) = report["invariance"]  # two `kvrescue run --deterministic` processes, at --batch 1 and 4
    assert invariance["deterministic"] and invariance["ok"] and invariance["agree"] == invariance["problems"] == 4
    runs = {(p["method"], p["cuda_graphs"]): p for p in report["problems"]
            if not p.get("warm_up") and not p.get("profile") and "streams" not in p}
    assert [(p["method"], p["streams"], p["skipped"]) for p in report["problems"] if "streams" in p] == [
        ("kvrescue", False, "streams need a GPU"), ("kvrescue", True, "streams need a GPU")]
    assert set(runs) == {("bon", True), ("bon", False), ("full", False), ("kvrescue", False), ("kvrescue", True)}
    assert runs[("bon", True)]["skipped"] == runs[("kvrescue", True)]["skipped"] == "CUDA graphs need a GPU"
    for method in ("bon", "full", "kvrescue"):
        p = runs[(method, False)]
        assert p["problems"] == 4 and not p["cut"]
        assert p["problems_per_min"] == pytest.approx(4 * 60 / p["seconds"])
        # synthetic steps 4:2, N = 2: every candidate is 4 tokens, every problem 2 steps
        assert p["base_tokens_per_problem"] == 2 * 2 * 4
        assert p["helper_tokens_per_problem"] == (16 if method == "kvrescue" else 0)
        assert p["planned_bytes"] > TINY_WEIGHT_BYTES  # the cell's memory plan (on a GPU beside its peaks)
        assert "peak_allocated_bytes" not in p
    # the paper's MATH500 profile at --batch auto (tiny: N = 2, 3 steps of 4 tokens), each phase's share of its time
    math500 = {p["method"]: p for p in report["problems"] if p.get("profile") == "MATH500"}
    assert set(math500) == {"bon", "full", "kvrescue"}
    for method, p in math500.items():
        assert p["problems"] == p["batch_auto"] == 4 and not p["cut"]
        assert p["base_tokens_per_problem"] == 3 * 2 * 4
        assert sum(p["time_share"].values()) == pytest.approx(1.0) and min(p["time_share"].values()) >= 0
        assert (p["time_share"]["helper decode"] > 0) == (method == "kvrescue")
    kvrescue = math500["kvrescue"]
    assert kvrescue["kvrescue_over_bon"] == pytest.approx(kvrescue["problems_per_min"] / math500["bon"]["problems_per_min"])
    assert kvrescue["kvrescue_over_full"] == pytest.approx(kvrescue["problems_per_min"] / math500["full"]["problems_per_min"])
    # one kvrescue cell's time by phase, adding up to its wall time, and the operations per decode iteration
    (profile,) = report["profile"]
    assert profile["problems"] == 2 and set(profile["seconds"]) == {
        "base decode", "helper decode", "sampling and detector", "PRM feed and scoring", "prefill",
        "commits and compression", "controller"}
    assert all(s >= 0 for s in profile["seconds"].values()) and all(s > 0 for p, s in profile["seconds"].items()
                                                                     if p != "controller")
    assert sum(profile["seconds"].values()) == pytest.approx(profile["wall_s"], rel=0.02)
    assert profile["calls"]["base.advance"] > 0 and profile["calls"]["scorer.launch"] > 0
    assert profile["calls"]["scorer.wait"] == profile["calls"]["scorer.launch"]
    assert profile["calls"]["base.prepare"] == profile["calls"]["base.advance"]  # each iteration's sampling timed
    assert profile["launches"]["aten_ops_per_iteration"] > 0 and profile["launches"]["graph_kernel_share"] is None
    # vLLM is not in .venv: the vllm section's records, in their usual shape, say why they were not measured
    # (tests/benchmarks/test_gpu_check_vllm.py measures them in .venv-vllm)
    assert report["vllm_version"] is None
    assert [(r["measure"], r["shape"], r["dtype"], r.get("batch"), r.get("new_tokens")) for r in report["vllm"]] == [
        ("decode", "tiny", "float32", 1, 8), ("decode", "tiny", "float32", 8, 8), ("decode", "tiny", "float32", 32, 8),
        ("prm", "tiny", "float32", None, None)]
    assert {k: v for k, v in report["vllm"][-1].items() if k != "skipped"} == {
        "measure": "prm", "shape": "tiny", "dtype": "float32", "problems": 2, "steps": 2, "candidates": 2}
    for r in report["vllm"]:
        assert r["skipped"].startswith("gpu_check's vllm section needs vLLM, which is not installed here")
        assert "scripts/setup_vllm.sh" in r["skipped"]
    # the caches' attention paths against a plain forward (paged, cascade) and the eager step (static, compressing)
    numerics = {r["path"]: r for r in report["numerics"]}
    assert set(numerics) == {"paged", "cascade", "static", "static appends"}
    assert all(r["ok"] for r in numerics.values()), numerics
    assert numerics["static"]["compressions"] >= 1 and not numerics["static"]["cuda_graphs"]
    assert numerics["static appends"]["buckets"] >= 2  # the two rounds' longest, 9 and 8 tokens: buckets 16 and 8
    # a finished cell's bytes, the collector off, on fake CUDA here (ok once no cycle keeps a cell's caches)
    (memory,) = report["memory"]  # two cells, one after the other
    assert memory["fake_cuda"] and memory["problems"] == 4 and memory["bytes_before"] > 0
    assert memory["ok"] and memory["growth_bytes"] == memory["workspace_bytes"] == 0  # freed by reference counting
    assert memory["bytes_after_first"] == memory["bytes_after_second"] == memory["bytes_before"]
    assert report["devices"] == [{"device": None, "skipped": "needs two or more visible GPUs"}]
    # one flushed progress line per measurement, then the table repeats every one of them
    progress = [line for line in lines if line.startswith("[")]
    assert len(progress) == (2 + len(report["numerics"]) + len(report["attention"]) + len(report["decode"])
                             + len(report["vllm"]) + len(report["memory"]) + len(report["devices"])
                             + len(report["invariance"]) + len(report["problems"]) + len(report["profile"])
                             + len(report["flex"]) + len(report["e2e"]))
    table = lines[len(progress):]
    assert sum(" tok/s " in line for line in table) == len(measured)
    assert any("full graphs=off: 4 problems" in line for line in table)
    assert sum(f"picks {model['picks']}, measured faster: {model['measured_faster']}" in line for line in table) == 1
    assert "traces at --batch 1/4 --deterministic: 4 of 4 problems agree, ok=True" in "\n".join(table)
    assert sum("engine vs vLLM" in line and "skipped (gpu_check's vllm section needs vLLM" in line
               for line in table) == 4


def test_budget_bounds_every_section(tmp_path, monkeypatch, capsys):
    """In this process (a check whose every measurement is skipped costs a process its imports, nothing else)."""
    out = tmp_path / "check.json"
    monkeypatch.setattr(sys, "argv", ["gpu_check.py", "--tiny", "--out", str(out), "--budget-s", "0"])
    load_gpu_check().main()
    report, lines = json.loads(out.read_text()), capsys.readouterr().out.splitlines()
    records = [report["roofline"], report["logits"], *report["decode"], *report["problems"]]
    assert len(records) == 2 + 20 + 8 + 3  # the problems section's synthetic runs (streams' too) and warm-up, then MATH500's
    records += [*report["numerics"], *report["memory"], *report["invariance"], *report["profile"], *report["e2e"],
                *report["flex"]]
    reasons = {r["skipped"].split(":")[0] for r in records}
    assert reasons == {"not started", "CUDA graphs need a GPU", "streams need a GPU"}
    assert all(r["of_roofline"] is None for r in report["decode"] if "of_roofline" in r)
    assert lines[-1].startswith("wrote ")


def test_the_e2e_section_runs_what_a_user_types(tiny_check):
    """Random checkpoints on disk, then each `kvrescue` command in its own process: the plan, bon, kvrescue and full
    at a fixed batch and at --batch auto, the rerun that loads nothing, report and view."""
    report, lines = tiny_check
    steps = report["e2e"]
    assert [r["step"] for r in steps] == ["checkpoints", "plan", "run", "run", "rerun", "report", "view"]
    assert steps[0]["bytes"] > 0
    for r in steps[1:]:
        assert r["exit"] == 0, r
        assert r["command"].startswith("kvrescue ") and "error" not in r
    plan, fixed, auto, rerun = steps[1:5]
    assert "--plan" in plan["command"] and plan["models_loaded"] == 0
    for run, batch in ((fixed, 2), (auto, None)):
        assert set(run["cells"]) == {"bon", "kvrescue", "full"}
        assert all(c["problems"] == 4 and c["problems_per_min"] > 0 for c in run["cells"].values())
        assert run["models_loaded"] == 3 and run["planned_bytes"] > 0 and "peak_allocated_bytes" not in run
        assert batch is None or run["batch"] == batch
    assert "--batch auto" in auto["command"] and auto["batch"] >= 4  # the 0.5 GiB it was left holds all 4 at once
    assert rerun["command"] == fixed["command"] and rerun["models_loaded"] == 0 and rerun["ok"]
    assert steps[-1]["page_bytes"] > 0
    table = "\n".join(lines)
    assert "rerun: exit 0" in table and "0 models loaded (ok=True)" in table and "plan: exit 0" in table


def load_gpu_check():
    return importlib.import_module("benchmarks.gpu_check.gpu_check")


def test_a_measurement_is_interrupted_at_its_deadline():
    module = load_gpu_check()
    start = time.perf_counter()
    with module.interrupted_at(start + 0.3) as cut:
        while time.perf_counter() < start + 30:
            time.sleep(0.01)
    assert cut() and time.perf_counter() - start < 10
    with module.interrupted_at(time.perf_counter() + 30) as cut:
        pass
    assert not cut()


def test_the_deadline_holds_in_a_job_that_ignores_sigint():
    """Started in the background (`&`, nohup), a process ignores SIGINT; the deadline still interrupts it."""
    module = load_gpu_check()
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        start = time.perf_counter()
        with module.interrupted_at(start + 0.3) as cut:
            while time.perf_counter() < start + 30:
                time.sleep(0.01)
        assert cut() and time.perf_counter() - start < 10
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, previous)
    assert signal.getsignal(signal.SIGUSR1) is signal.SIG_DFL


def test_the_default_device_cuda_is_made_current_by_its_index(monkeypatch):
    """`gpu_check.py --out gpu_check.json` on a GPU: `--device` defaults to `cuda`, which `torch.cuda.set_device`
    refuses without an index (faked here with PyTorch's own validation); the check reads it as the current GPU."""
    module = load_gpu_check()
    made_current = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: made_current.append(_get_device_index(device)))
    unset_allocator_settings(monkeypatch)  # the check sets them
    assert module.chosen_device(None, tiny=False) == "cuda:3" and made_current == [3]
    assert module.chosen_device("cuda:1", tiny=False) == "cuda:1" and made_current == [3, 1]
    assert module.chosen_device(None, tiny=True) == "cpu" and made_current == [3, 1]
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"


def test_the_memory_section_tells_a_one_time_workspace_from_a_leak(monkeypatch):
    """Two kvrescue cells on fake CUDA, the collector off. A cell that keeps a fake-CUDA tensor in a reference cycle
    (what the section is for: with the collector off nothing frees it) leaks as much again in the second cell; a
    buffer made once for the process, as cuBLAS makes its workspace, is left by the first cell and not grown."""
    from benchmarks.gpu_check import gpu_check_memory
    from benchmarks.gpu_check.gpu_check_setup import SMALL

    def run(kept_once: list, leak: bool):
        def decode(*args, **kwargs):
            if not kept_once:
                kept_once.append(torch.empty(1024, device="cuda:0"))  # 4 KiB once: a workspace
            if leak:
                cycle: dict = {"kv": torch.empty(256, device="cuda:0")}  # 1 KiB a cell, kept by the cycle
                cycle["self"] = cycle
            return real_decode(*args, **kwargs)

        monkeypatch.setattr(gpu_check_memory, "decode_cell", decode)
        return gpu_check_memory.cell_memory("cpu", torch.float32, True, SMALL)

    real_decode = gpu_check_memory.decode_cell
    clean = run([], leak=False)
    assert clean["fake_cuda"] and clean["problems"] == 4 and clean["cells"] == 2
    assert clean["ok"] and clean["growth_bytes"] == 0 and clean["workspace_bytes"] == 4096
    leaking = run([], leak=True)
    assert not leaking["ok"] and leaking["growth_bytes"] == 1024 and leaking["workspace_bytes"] == 4096
    assert leaking["bytes_after_first"] - leaking["bytes_before"] == 4096 + 1024
    assert gpu_check_memory.left_by_cells(100, 100, 100) == {
        "bytes_before": 100, "bytes_after_first": 100, "bytes_after_second": 100, "workspace_bytes": 0,
        "growth_bytes": 0, "ok": True}


def test_a_measurement_in_a_window_after_the_budget_runs_until_the_windows_end(tmp_path):
    """The profile and MATH500 run after the budget, in windows of their own: a measurement given `until` is
    interrupted there, not at the (past) end of the budget."""
    module = load_gpu_check()

    class Kept(module.Check):
        def add(self, section: str, record: dict) -> None:  # kept, not described
            self.report.setdefault(section, []).append(record)

    check = Kept(tmp_path / "check.json", {}, budget_s=0.0)
    window = time.perf_counter() + 4.0  # room for the first measurement on a loaded machine

    def sleeps(seconds: float) -> dict:
        start = time.perf_counter()
        while time.perf_counter() < start + seconds:
            time.sleep(0.01)
        return {"slept_s": seconds}

    check.measure("profile", {}, window, lambda: sleeps(0.2), until=window)
    check.measure("profile", {}, window, lambda: sleeps(30), until=window)
    ran, cut = check.report["profile"]
    assert ran["slept_s"] == 0.2 and "skipped" not in ran
    assert cut["skipped"].startswith("interrupted") and cut["seconds_taken"] < 10
