"""gpu_check's `roofline`, `attention` and `decode` sections: copy bandwidth and matrix-product rate, the full cache's
attention, and decode tokens/s of this engine and transformers `generate` against the roofline (the longer of a
step's reads at the bandwidth and its FLOPs at the product rate)."""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import torch

from benchmarks.gpu_check.gpu_check_record import Check
from benchmarks.gpu_check.gpu_check_setup import (DECODE_SHARE, PARAMS, QWEN25_MATH_7B, TINY, hf_model, sync, timed,
    too_big)
from kvrescue.engine.bounded import BoundedCache
from kvrescue.engine.caches import FullCache
from kvrescue.engine.graphs import StaticDecode
from kvrescue.engine.loader import build_network
from kvrescue.engine.model import Transformer
from kvrescue.engine.sampling import sample


def device_limits(device: str, dtype: torch.dtype, tiny: bool) -> dict:
    """The device's two limits: device-to-device copy bandwidth (bytes read + written per second) and the rate of a
    square matrix product in the run's dtype (FLOP/s)."""
    n = (64 if tiny else 2048) * 2**20
    src = torch.empty(n, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    seconds = timed(device, lambda: dst.copy_(src), repeat=5)
    side = 512 if tiny else 8192
    a, b = torch.randn(side, side, device=device, dtype=dtype), torch.randn(side, side, device=device, dtype=dtype)
    product_s = timed(device, lambda: torch.mm(a, b), repeat=10)
    return {"bytes": n, "seconds": seconds, "bytes_per_s": 2 * n / seconds, "matmul_side": side,
            "matmul_dtype": str(dtype).removeprefix("torch."), "matmul_flop_per_s": 2 * side**3 / product_s}


def roofline(rate: float, rows: int, step_bytes: float, token_flops: float, limits: dict) -> dict:
    """A decode rate next to its bound: a step takes at least the longer of reading the weights and each row's cached
    K/V once at the copy bandwidth and computing each row's token at the matrix-product rate."""
    bandwidth, flop_rate = limits.get("bytes_per_s"), limits.get("matmul_flop_per_s")
    step_s = max(step_bytes / bandwidth, rows * token_flops / flop_rate) if bandwidth and flop_rate else None
    bound = rows / step_s if step_s else None
    return {"tokens_per_s": rate, "step_bytes": step_bytes, "token_flops": token_flops,
            "roofline_tokens_per_s": bound, "bound_by": None if not step_s else
            "memory" if step_s == step_bytes / bandwidth else "compute", "of_roofline": rate / bound if bound else None}


def token_flops(shape: dict, mean_read: float) -> float:
    """FLOPs of one decoded token: 2 per weight of every matrix product (all but the embedding lookup), and
    attention's q.K and p.V over the `mean_read` cached entries, 2 each per head dimension."""
    h, layers = shape["hidden_size"], shape["num_hidden_layers"]
    kv = shape["num_key_value_heads"] * h // shape["num_attention_heads"]
    per_layer = h * (h + 2 * kv) + h * h + 3 * h * shape["intermediate_size"]
    return 2 * (layers * per_layer + shape["vocab_size"] * h) + 4 * layers * h * mean_read


def filled_cache(net: Transformer, policy: str, budget: int, rows: int, context: int,
                 steps: int) -> tuple[BoundedCache | FullCache, list[int]]:
    """A cache whose rows look prefilled with `context` tokens (random K/V, no prefill run): an evicting
    row holds between `budget` and B' - 1 entries, staggered so compressions spread as in steady decoding;
    `none` is the full cache `kvrescue run` builds for it, each row holding all `context` tokens."""
    if policy == "none":
        from benchmarks.speed.evict_bench import make_paged_rows

        return make_paged_rows(net, rows, context, steps + 1, candidates=1)  # each row forked from its own prefix
    cache = BoundedCache.for_model(net, budget=budget, evictor=policy, max_append=1, rows=rows + 1)
    cache.k.normal_()
    cache.v.normal_()
    cache.q.normal_()
    ids = [cache.create() for _ in range(rows)]
    span = cache.trigger - budget
    physical = budget + (np.arange(rows) * span) // rows
    cache.row_physical[ids] = cache.row_peak[ids] = physical  # benchmark only: as if `context` tokens had been prefilled
    cache.row_logical[ids] = context
    return cache, ids


def decode_rate(net: Transformer, device: str, policy: str, budget: int, rows: int, context: int, steps: int,
                graphs: bool) -> float:
    """Tokens/s of `steps` one-token decode steps over `rows` rows, each sampling its next token from
    the fp32 logits (with the entropy) as the controller does."""
    cache, ids = filled_cache(net, policy, budget, rows, context, steps)
    tokens = torch.randint(0, net.args.vocab_size, (rows,)).tolist()
    keys = [(0, 0, 0, r) for r in range(rows)]
    static = StaticDecode(net, cache, graphs=True) if graphs else None

    def step(t: int) -> None:
        nonlocal tokens
        if static is not None:
            logits = static(ids, tokens)
        else:
            logits = net.decode(torch.tensor(tokens, device=device), cache, ids)
        picked, _ = sample(logits.float(), keys, [t] * rows, PARAMS)
        tokens = picked.tolist()

    with torch.inference_mode():
        step(0)  # warm-up (and capture)
        sync(device)
        start = time.perf_counter()
        for t in range(1, steps + 1):
            step(t)
        sync(device)
    return rows * steps / (time.perf_counter() - start)


def hf_rate(hf, device: str, dtype: torch.dtype, rows: int, context: int, steps: int) -> float:
    """Tokens/s of transformers `generate` (sampling at the paper's settings, `steps` new tokens) over a
    cache prefilled with random K/V."""
    from transformers import DynamicCache

    cfg = hf.config
    head_dim = cfg.hidden_size // cfg.num_attention_heads

    def prefilled():
        cache = DynamicCache(config=cfg)
        for layer in range(cfg.num_hidden_layers):
            k = torch.randn(rows, cfg.num_key_value_heads, context, head_dim, device=device, dtype=dtype)
            cache.update(k, torch.randn_like(k), layer)
        return cache, torch.randint(0, cfg.vocab_size, (rows, context + 1), device=device)

    def generate(cache, ids) -> None:
        hf.generate(input_ids=ids, attention_mask=torch.ones_like(ids), past_key_values=cache, max_new_tokens=steps,
                    min_new_tokens=steps, do_sample=True, temperature=PARAMS.temperature, top_p=PARAMS.top_p,
                    top_k=PARAMS.top_k, pad_token_id=0)

    with torch.inference_mode():
        generate(*prefilled())  # warm-up
        inputs = prefilled()
        sync(device)
        start = time.perf_counter()
        generate(*inputs)
        sync(device)
    return rows * steps / (time.perf_counter() - start)


def attention_section(check: Check, device: str, dtype: torch.dtype, tiny: bool) -> None:
    """The full cache's attention, gather vs paged vs cascade, each shape recorded as it ends."""
    from benchmarks.speed.attention_bench import measure_shape

    for problems in (2,) if tiny else (8, 64):
        for context in (64,) if tiny else (1024, 2048, 4096):
            check.measure("attention", {"context": context, "problems": problems}, check.deadline(DECODE_SHARE),
                          lambda: measure_shape(device, dtype, context, problems, layers=1 if tiny else 28, max_gib=16))


def decode_section(check: Check, device: str, dtype: torch.dtype, tiny: bool, plan: dict) -> None:
    """Every decode configuration, with its roofline; each recorded as it ends. The models are built at
    the first measurement taken."""
    shape = TINY if tiny else QWEN25_MATH_7B
    built: dict[str, Any] = {}

    def models() -> tuple[Any, Transformer, int]:
        if not built:
            built["hf"] = hf = hf_model(shape, device, dtype, seed=2)
            config = {**hf.config.to_dict(), "model_type": "qwen2"}
            built["net"] = build_network(dict(hf.state_dict()), config, dtype, device)
            built["weight_bytes"] = sum(p.numel() * p.element_size() for p in built["net"].parameters())
        return built["hf"], built["net"], built["weight_bytes"]

    head_dim = shape["hidden_size"] // shape["num_attention_heads"]
    entry = 2 * shape["num_hidden_layers"] * shape["num_key_value_heads"] * head_dim * dtype.itemsize  # K + V bytes
    limits = check.report.get("roofline", {})
    deadline = check.deadline(DECODE_SHARE)
    caches = [("rkv", b) for b in plan["budgets"]] + [("none", None)]
    for rows in plan["rows"]:
        for context in plan["contexts"]:
            for policy, budget in caches:
                held = context + plan["steps"] if policy == "none" else budget + 128
                mean_read = context + plan["steps"] / 2 if policy == "none" else budget + 64
                for graphs in (False, True):
                    record = {"engine": "kvrescue", "rows": rows, "context": context, "evictor": policy,
                              "budget": budget, "cuda_graphs": graphs}
                    if graphs and not device.startswith("cuda"):
                        check.add("decode", {**record, "skipped": "CUDA graphs need a GPU"})
                        continue
                    check.measure("decode", record, deadline, lambda: roofline(
                        decode_rate(models()[1], device, policy, budget or 64, rows, context, plan["steps"], graphs),
                        rows, models()[2] + rows * mean_read * entry, token_flops(shape, mean_read), limits),
                        too_big(device, rows * held * entry))
            record = {"engine": "transformers-generate", "rows": rows, "context": context, "evictor": "none",
                      "budget": None, "cuda_graphs": False}
            need = 2 * rows * (context + plan["steps"]) * entry  # generate's cache grows by concatenation
            mean_read = context + plan["steps"] / 2
            check.measure("decode", record, deadline, lambda: roofline(
                hf_rate(models()[0], device, dtype, rows, context, plan["steps"]), rows,
                models()[2] + rows * mean_read * entry, token_flops(shape, mean_read), limits), too_big(device, need))
