"""gpu_check's plans and models: the shapes measured, the tiny and full plans, random-weight models, timing."""

from __future__ import annotations

import time

import torch

from kvrescue.engine.loader import LoadedModel
from kvrescue.engine.model import CausalLM, ModelArgs, ProcessRewardModel, Transformer
from kvrescue.engine.sampling import SamplingParams
from kvrescue_testkit.paper_shapes import (QWEN25_05B, QWEN25_MATH_7B, QWEN25_MATH_15B,  # noqa: F401 (the sections' shapes)
                                       QWEN25_MATH_PRM_7B, hf_config)

TINY = dict(vocab_size=1024, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, rope_theta=10000.0, tie_word_embeddings=False)

# The vLLM section's shapes on the CPU: vLLM's CPU attention takes head sizes from 32 up.
TINY_VLLM = dict(TINY, num_attention_heads=2, num_key_value_heads=1)

FULL = dict(rows=(64, 256, 512), budgets=(64, 512), contexts=(1024, 4096), steps=32, problems=64, n=8, batch=8,
            budget=64, synthetic=(32, 6), logit_tokens=256,
            vllm_batches=(1, 8, 32), vllm_new_tokens=64, vllm_repeats=2, vllm_prm=(4, 4, 8), vllm_kv_mib=512,
            vllm_eager=False)
SMALL = dict(rows=(4, 8), budgets=(16,), contexts=(64, 160), steps=4, problems=4, n=2, batch=2,
             budget=16, synthetic=(4, 2), logit_tokens=24,
             vllm_batches=(1, 8, 32), vllm_new_tokens=8, vllm_repeats=1, vllm_prm=(2, 2, 2), vllm_kv_mib=64,
             vllm_eager=True)  # no Dynamo trace at each vLLM start (~17 s on 2 cores)
DECODE_SHARE = 0.5  # decode measurements start only in the first half of the budget
VLLM_SHARE = 0.75  # vLLM measurements start and end within the first 3/4 of it; problems get the rest
# Windows of their own after the budget, as shares of it (of the default 240 s: 90 s and 150 s; the whole check then
# takes about 8 minutes): the profile and the MATH500 profile (the problems section's last measurements), then e2e
PROFILE_WINDOW, E2E_SHARE = 0.375, 0.625
VLLM_MEMORY = 0.4  # vLLM's share of the device (this engine's model and cache take the rest)
PARAMS = SamplingParams()  # the paper's sampling, on both sides of every decode comparison
# (method, CUDA graphs) of the problems section, each pair alternating its order
PROBLEM_RUNS = (("bon", True), ("bon", False), ("full", False), ("kvrescue", False), ("kvrescue", True))


def hf_model(shape: dict, device: str, dtype: torch.dtype, seed: int):
    """A transformers Qwen2ForCausalLM with random weights, initialised on `device` in `dtype`."""
    from transformers import Qwen2ForCausalLM

    torch.manual_seed(seed)
    with torch.device(device):
        return Qwen2ForCausalLM._from_config(hf_config(shape), dtype=dtype, attn_implementation="sdpa").eval()


def random_engine(shape: dict, device: str, dtype: torch.dtype, seed: int, prm: bool = False) -> Transformer:
    """An engine decoder (LM or PRM head) with N(0, 0.02) weights and unit norms, allocated on `device`."""
    args = ModelArgs.from_hf({**hf_config(shape).to_dict(), "model_type": "qwen2"})
    with torch.device("meta"):
        net = (ProcessRewardModel if prm else CausalLM)(args)
    net = net.to(dtype).to_empty(device=device)
    generator = torch.Generator(device).manual_seed(seed)
    for name, param in net.named_parameters():
        if name.endswith("norm.weight"):
            param.data.fill_(1.0)
        else:
            param.data.normal_(0.0, 0.02, generator=generator)
    if isinstance(net, CausalLM):
        net.tie_weights()
    return net.eval()


def random_loaded(shape: dict, device: str, dtype: torch.dtype, seed: int, tokenizer, role: str) -> LoadedModel:
    """A `random_engine` (a PRM for role "prm") as `load_model` returns a model, with `tokenizer`."""
    net = random_engine(shape, device, dtype, seed=seed, prm=role == "prm")
    config = hf_config(shape, tokenizer).to_dict()
    return LoadedModel(net, tokenizer, config, f"random-{role}", [tokenizer.eos_token_id])


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)


def timed(device: str, fn, repeat: int = 1) -> float:
    """Seconds per call of `fn` (after one warm-up call)."""
    fn()
    sync(device)
    start = time.perf_counter()
    for _ in range(repeat):
        fn()
    sync(device)
    return (time.perf_counter() - start) / repeat


def free_bytes(device: str) -> float:
    return torch.cuda.mem_get_info(device)[0] if device.startswith("cuda") else float("inf")


def too_big(device: str, need: float) -> str | None:
    """Why a cache of `need` bytes is not built, or None when it fits."""
    return f"needs {need / 2**30:.0f} GiB of KV cache" if need > 0.8 * free_bytes(device) else None
