"""The memory planner against the bytes a real cell allocates on the CPU, and its uses (refusal, --batch auto)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from kvrescue_cli import decoding, memory_plan
from kvrescue_cli.data import Problem, ProblemSet
from kvrescue_cli.grid import Cell, GridOptions
from kvrescue_cli.prompts import generation_prompt
from kvrescue_cli.random_checkpoints import build_tokenizer, write_random_checkpoint
from kvrescue_cli.search import SearchSettings
from tests.tensor_bytes import TensorBytes, parameter_bytes

SHAPE = dict(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=256, init_std=0.1)
STEP_TOKEN = "!"  # re-encodes to itself, one token each, and never makes a step delimiter


@pytest.fixture(scope="module")
def worst_case_dirs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A Qwen2 checkpoint that samples `!` after every token (its layers' outputs zeroed, so the last hidden state
    is the embedding's direction, which only `!`'s head row follows), and a PRM: every step then has exactly the
    tokens it was given, in the policy's and the PRM's tokenizer alike, so a cell reaches the shapes it is planned
    for (its longest steps, its whole context)."""
    import torch
    from safetensors.torch import load_file, save_file

    policy = write_random_checkpoint(tmp_path_factory.mktemp("bang"), "qwen2", seed=7, **SHAPE)
    weights = load_file(policy / "model.safetensors")
    for name in weights:
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            weights[name].zero_()
    weights["model.embed_tokens.weight"][:] = 1.0
    weights["model.norm.weight"][:] = 1.0
    weights["lm_head.weight"][build_tokenizer().convert_tokens_to_ids(STEP_TOKEN)] = 1.0
    save_file(weights, policy / "model.safetensors", metadata={"format": "pt"})
    prm = write_random_checkpoint(tmp_path_factory.mktemp("bang-prm"), "prm", seed=8, **SHAPE)
    return policy, prm


def measured_cell(policy: Path, prm: Path, method: str, scorer: str, batch: int, n: int, step: int, cap: int,
                  tmp_path: Path) -> tuple[int, memory_plan.DevicePlan]:
    """Weights + the peak bytes of the tensors live during one real cell (synthetic steps of `step` tokens until
    the context cap), and the planner's plan for it with the cell's prompt length."""
    import torch

    models = {"base": str(policy), "helper": str(policy), "prm": str(prm) if scorer == "prm" else scorer}
    options = GridOptions(benches=["t"], methods=[method], budgets=[16], ns=[n], seeds=[0], evictor="rkv",
                          models=models, scorer=scorer, out=tmp_path, dtype="float32",
                          settings=SearchSettings(batch=batch, synthetic_steps=(step, 1000), max_step_tokens=step,
                                                  context_cap=cap))
    problems = [Problem(i, "What is one plus one?", "2", {}) for i in range(batch)]
    loaded = decoding.load_roles(options, "cpu")
    tokenizer = loaded["base" if "base" in loaded else "helper"].tokenizer
    prompt = len(tokenizer.encode(generation_prompt(tokenizer, problems[0].problem), add_special_tokens=False))
    weights = parameter_bytes(*{id(m.net): m.net for m in loaded.values()}.values())
    cell = Cell(ProblemSet("t", "generic", "t.jsonl", problems), method, 16, n, 0)
    mode = TensorBytes()
    with torch.inference_mode(), mode:
        decoding.decode(options, cell, loaded, problems, lambda trace, tokens: None)
    shape = replace(memory_plan.cell_shapes(options)[0], prompt_tokens=prompt)
    plan = memory_plan.plan_cell(memory_plan.grid_models(options), shape, memory_plan.DeviceKind(dtype_bytes=4))
    return weights + mode.peak, plan


@pytest.mark.parametrize("method, scorer, batch, n, step, cap", [
    ("bon", "prm", 1, 16, 64, 512),       # the PRM scoring 16 candidates over the whole context
    ("kvrescue", "prm", 2, 4, 96, 640),   # base and helper candidates, the base's compression
    ("full", "prm", 2, 2, 128, 640),      # the full base cache, long steps
])
def test_the_plan_is_within_10_percent_of_a_cells_measured_peak(worst_case_dirs, tmp_path, method, scorer, batch,
                                                                 n, step, cap):
    measured, plan = measured_cell(*worst_case_dirs, method, scorer, batch, n, step, cap, tmp_path)
    assert abs(plan.total - measured) <= 0.1 * measured, (plan.total, measured, plan.peak_moment)
