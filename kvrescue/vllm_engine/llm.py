"""Start a vLLM engine (`vllm.LLM`) on a model folder or Hub id with this tool's settings.

On a CPU vLLM's `gpu_memory_utilization` is the share of RAM it reserves (its default, 0.92, fails on a shared
machine), so a CPU engine is given its KV cache's size in bytes instead. The engine core is a spawned process:
a script that starts one needs the `if __name__ == "__main__"` guard.

A pooling engine (the PRM's) pools `ALL` tokens with prefix caching on: vLLM allows the prefix cache for causal
pooling models except with `STEP` pooling (the PRM's default; `ModelConfig.is_prefix_caching_supported` in 0.32),
and with it each request returns the head at the tokens it computed, its last one among them, where every PRM
recipe reads the score (prm.pooling_args: the head each recipe reads).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from kvrescue import hub
from kvrescue.vllm_engine import require_vllm


def start_llm(
    model: str | Path,
    *,
    dtype: str,
    max_model_len: int,
    runner: Literal["generate", "pooling"] = "generate",
    memory: float | None = None,
    kv_cache_bytes: int | None = None,
    seed: int = 0,
    **engine_args: Any,
):
    """A `vllm.LLM`: `runner` "pooling" for a PRM's token scores, "generate" for sampling; `memory` is the share
    of the device (vLLM's gpu_memory_utilization), `kv_cache_bytes` the KV cache's exact size (wins over it)."""
    vllm = require_vllm()
    if runner == "pooling":
        from vllm.config import PoolerConfig

        engine_args.setdefault("pooler_config", PoolerConfig(tok_pooling_type="ALL"))
        engine_args.setdefault("enable_prefix_caching", True)
    if memory is not None:
        engine_args["gpu_memory_utilization"] = memory
    if kv_cache_bytes is not None:
        engine_args["kv_cache_memory_bytes"] = kv_cache_bytes
    engine_args.setdefault("revision", hub.revision_of(str(model)))  # --base-revision and the others
    return vllm.LLM(model=str(model), dtype=dtype, max_model_len=max_model_len, runner=runner, seed=seed,
                    **engine_args)
