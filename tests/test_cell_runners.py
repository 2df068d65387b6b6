"""A cell's caches (`kvrescue/cell_runners.py`) take the contexts the run's caps allow, however long."""

from __future__ import annotations

from kvrescue_testkit.random_checkpoints import write_random_checkpoint
from tests.helpers import kvrescue_run, ok, traces_of, write_jsonl


def test_a_context_past_8192_tokens_runs_on_full_and_evicted_caches(tmp_path):
    """Long-CoT models take 32k-token contexts (`--context-cap 32768`): every full-context cache (the helper's,
    the `full` base's, helper-loglik's) holds rows up to the cap and a step, not a fixed 8,192 tokens. A ~9,000-token
    prompt past that, on a model whose window takes it, decodes under kvrescue and full (a 32k one took 2 min here)."""
    model = write_random_checkpoint(tmp_path / "long-window", "qwen2", max_positions=16384)
    question = " ".join(f"{i} + {i} = {2 * i}." for i in range(560)) + " What is 2 + 2?"
    problems = write_jsonl(tmp_path / "tiny.jsonl", [{"question": question, "answer": "4"}])
    ok(kvrescue_run("--base", str(model), "--helper", str(model), "--prm", "helper-loglik", "--bench", str(problems),
                    "--method", "kvrescue,full", "--budget", "64", "--n", "2", "--max-steps", "1",
                    "--max-step-tokens", "4", "--context-cap", "9600", "--dtype", "float32", "--out", str(tmp_path / "out")))
    (kvrescue,), (full,) = traces_of(tmp_path / "out"), traces_of(tmp_path / "out", "full")
    assert kvrescue["n_steps"] == full["n_steps"] == 1
    assert 8192 < kvrescue["tokens"]["helper_prefill"] < 9600 and 8192 < full["tokens"]["base_prefill"] < 9600
    assert kvrescue["peak_base_rows"] == kvrescue["tokens"]["base_prefill"]  # the evicted row held it until compressed
