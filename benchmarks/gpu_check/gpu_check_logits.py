"""gpu_check's `logits` section: this engine vs transformers, a plain forward and prefill + static decode steps."""

from __future__ import annotations

import torch

from benchmarks.gpu_check.gpu_check_setup import QWEN25_05B, TINY, hf_model
from kvrescue.engine.bounded import BoundedCache
from kvrescue.evictor_catalogue import MIN_BUDGET
from kvrescue.engine.graphs import StaticDecode
from kvrescue.engine.loader import build_network


def compare(got: torch.Tensor, ref: torch.Tensor) -> dict:
    """How far logits `got` are from `ref` (both [..., V], fp32)."""
    diff = (got - ref).abs()
    cos = torch.nn.functional.cosine_similarity(got.flatten(0, -2), ref.flatten(0, -2), dim=-1)
    return {"max_abs": diff.max().item(), "mean_abs": diff.mean().item(), "ref_std": ref.std().item(),
            "min_cosine": cos.min().item(),
            "top1_agreement": (got.argmax(-1) == ref.argmax(-1)).float().mean().item()}


def verdict(dtype: torch.dtype, comparisons: list[dict]) -> dict:
    """`tolerance` (the dtype's) and `ok` (every comparison within it)."""
    if dtype == torch.float32:
        return {"tolerance": "max_abs <= 1e-3", "ok": all(c["max_abs"] <= 1e-3 for c in comparisons)}
    return {"tolerance": "min_cosine >= 0.99 and mean_abs <= 0.05 * ref_std",
            "ok": all(c["min_cosine"] >= 0.99 and c["mean_abs"] <= 0.05 * c["ref_std"] for c in comparisons)}


def check_logits(device: str, dtype: torch.dtype, tiny: bool, plan: dict) -> dict:
    """Engine vs transformers logits: a plain forward, then prefill + static decode steps."""
    shape = TINY if tiny else QWEN25_05B
    hf = hf_model(shape, device, dtype, seed=0)
    config = {**hf.config.to_dict(), "model_type": "qwen2"}
    net = build_network(dict(hf.state_dict()), config, dtype, device)
    tokens = plan["logit_tokens"]
    ids = torch.randint(0, shape["vocab_size"], (2, tokens), device=device, generator=torch.Generator(device).manual_seed(1))
    with torch.inference_mode():
        want = hf(input_ids=ids).logits.float()
        plain = net(ids).float()
        prefix = tokens * 3 // 4
        # a budget beyond the sequence: nothing is evicted, so transformers' full attention is the reference
        cache = BoundedCache.for_model(net, budget=max(tokens, MIN_BUDGET), evictor="rkv", max_append=tokens, rows=4)
        rows = [cache.create() for _ in range(2)]
        steps = [net.prefill(ids[:, :prefix], cache, rows, [prefix] * 2).float()]
        decode_step = StaticDecode(net, cache, graphs=device.startswith("cuda"))
        for t in range(prefix, tokens - 1):
            steps.append(decode_step(rows, ids[:, t].tolist()).float())
        assert all(cache.physical_length(r) == cache.length(r) for r in rows), "the check's rows were evicted"
    stepped = torch.stack(steps, dim=1)

    result = {"shape": "tiny" if tiny else "Qwen2.5-0.5B", "dtype": str(dtype).removeprefix("torch."),
              "tokens": tokens, "forward": compare(plain, want),
              "prefill_then_decode": compare(stepped, want[:, prefix - 1: tokens - 1])}
    return {**result, **verdict(dtype, [result["forward"], result["prefill_then_decode"]])}
