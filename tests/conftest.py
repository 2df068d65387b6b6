"""Shared fixtures: small random checkpoints written once per session through the real saving code."""

from pathlib import Path

import pytest

from kvrescue_cli.random_checkpoints import write_random_checkpoint

TINY = dict(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128, init_std=0.1)


@pytest.fixture(scope="session")
def qwen2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random Qwen2 checkpoint (q/k/v bias, GQA, untied head, rope theta 5000)."""
    return write_random_checkpoint(tmp_path_factory.mktemp("qwen2"), "qwen2", rope_theta=5000.0, seed=1, **TINY)


@pytest.fixture(scope="session")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random Llama checkpoint (no bias, tied embeddings)."""
    return write_random_checkpoint(tmp_path_factory.mktemp("llama"), "llama", seed=2, **TINY)


@pytest.fixture(scope="session")
def prm_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random Qwen2ForProcessRewardModel checkpoint (Qwen2 decoder + score head)."""
    return write_random_checkpoint(tmp_path_factory.mktemp("prm"), "prm", seed=3, **TINY)
