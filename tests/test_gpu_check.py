"""`benchmarks/gpu_check.py --tiny`: the one-call GPU check runs end to end on the CPU with tiny shapes."""

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_check.py"


def test_gpu_check_tiny_runs_end_to_end(tmp_path):
    out = tmp_path / "check.json"
    done = subprocess.run([sys.executable, str(SCRIPT), "--tiny", "--out", str(out)], capture_output=True, timeout=600)
    assert done.returncode == 0, done.stderr.decode()[-3000:]
    report = json.loads(out.read_text())
    assert report["tiny"] and report["roofline"]["bytes_per_s"] > 0
    logits = report["logits"]
    assert logits["ok"], logits
    assert logits["prefill_then_decode"]["top1_agreement"] == 1.0
    measured = [d for d in report["decode"] if "skipped" not in d]
    assert {d["engine"] for d in measured} == {"kvrescue", "transformers-generate"}
    assert {d["evictor"] for d in measured} == {"rkv", "none"}
    assert all(d["tokens_per_s"] > 0 and 0 < d["of_roofline"] for d in measured)
    assert all(d["skipped"] == "CUDA graphs need a GPU" for d in report["decode"] if d["cuda_graphs"])
    assert [(p["method"], p["problems"]) for p in report["problems"]] == [("bon", 4), ("kvrescue", 4), ("full", 4)]
    assert all(p["problems_per_min"] > 0 for p in report["problems"])
