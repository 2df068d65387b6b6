"""gpu_check's streams comparison (`benchmarks/gpu_check/gpu_check_streams.py`), run on the fake CUDA device: one
kvrescue cell with one stream, then with a stream per model, both measured and compared."""

import json
import os
import time

import torch

from benchmarks.gpu_check.gpu_check_problems import problems_rate, synthetic_grid
from benchmarks.gpu_check.gpu_check_record import Check
from benchmarks.gpu_check.gpu_check_streams import streams_comparison
from kvrescue.engine import streams as model_streams
from kvrescue_testkit.dry_run import TokenScript, fake_model
from kvrescue_testkit.fake_cuda import FakeCuda
from kvrescue_testkit.paper_shapes import SMALL_MODELS
from kvrescue_testkit.random_checkpoints import build_tokenizer



def test_kvrescue_is_measured_with_one_stream_then_a_stream_per_model(tmp_path, monkeypatch):
    monkeypatch.setattr(model_streams, "_STREAMS", {})
    monkeypatch.delenv("KVRESCUE_STREAMS", raising=False)
    tokenizer = build_tokenizer(512)
    plan = dict(n=2, budget=16, synthetic=(2, 2), batch=2, problems=2)
    check = Check(tmp_path / "check.json", {}, budget_s=600)
    with FakeCuda(host_reads=TokenScript(tokenizer.encode(" x", add_special_tokens=False)[0])) as cuda:
        models = {role: fake_model(shape, role, tokenizer, torch.bfloat16, "cuda:0") for role, shape in SMALL_MODELS.items()}
        options, problems = synthetic_grid(plan, "cuda:0", torch.bfloat16, plan["problems"])
        streams_comparison(check, options, lambda: models, problems, plan, time.perf_counter() + 300, problems_rate)
        roles = {role: cuda.order.kernels[stream.name] for (_, _, role), stream in model_streams._STREAMS.items()}
    one, per_model = check.report["problems"]
    assert (one["streams"], per_model["streams"]) == (False, True) and "KVRESCUE_STREAMS" not in os.environ
    assert one["problems"] == per_model["problems"] == 2 and not one["cut"] and not per_model["cut"]
    assert per_model["over_one_stream"] == per_model["problems_per_min"] / one["problems_per_min"]
    assert per_model["same_outputs"] is True  # the fake device's scripted tokens: equal by construction here
    assert set(roles) == {"base", "helper", "prm"} and all(roles.values())  # each model's stream made and used
    assert json.loads((tmp_path / "check.json").read_text())["problems"][1]["streams"] is True
