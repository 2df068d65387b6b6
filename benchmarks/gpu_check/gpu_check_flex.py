"""gpu_check's `flex` section: decode tokens/s with attention through FlexAttention (the pools read in place,
`kvrescue/engine/flex.py`) against SDPA (the rows' keys gathered), each pair measured back to back in this run, at
issue 40's shapes: rows 64 / 256 / 512, the bounded cache at B = 64 and 512 and the full cache at 1k tokens of
context, each eagerly and through its static step (CUDA graphs); then a full cache's forwards of 32 tokens a row over
1k and 2k cached (the PRM's scoring shape, 16 and 128 rows, step "forward"); with the logits of the first step or
forward of each from equal caches compared. On a CPU (--tiny) FlexAttention runs eagerly, PyTorch's reference
implementation: the section's code runs, its rates mean nothing."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

import kvrescue.engine.flex as flex
from benchmarks.gpu_check.gpu_check_decode import filled_cache
from benchmarks.gpu_check.gpu_check_record import Check
from benchmarks.gpu_check.gpu_check_setup import DECODE_SHARE, QWEN25_MATH_7B, TINY, hf_model, sync, too_big
from kvrescue.engine.caches import FullCache, block_size_for
from kvrescue.engine.graphs import StaticDecode
from kvrescue.engine.loader import build_network

FULL_CONTEXT = 1024
# Forwards of several tokens a row over cached keys, at the PRM's scoring shape: rows x 32 tokens over 1k-2k cached
FORWARD_ROWS, FORWARD_CONTEXTS, FORWARD_TOKENS, FORWARD_REPEATS = (16, 128), (1024, 2048), 32, 4


def _cache(net, policy: str, budget: int | None, rows: int, context: int, steps: int, static: bool):
    """A filled cache (`gpu_check_decode.filled_cache`'s) and its rows, with its static step when `static`; a full
    cache's is made before its rows, which it reserves a scratch block ahead of."""
    if policy != "none":
        cache, ids = filled_cache(net, policy, budget, rows, context, steps)
        return cache, ids, StaticDecode(net, cache) if static else None
    bs = block_size_for(next(net.parameters()))
    per_row = -(-(context + steps + 1) // bs)
    cache = FullCache.for_model(net, rows * per_row * bs, max_rows=rows, max_row_tokens=per_row * bs, block_size=bs)
    step = StaticDecode(net, cache) if static else None
    cache.k.normal_()
    cache.v.normal_()
    ids = [cache.create() for _ in range(rows)]
    table = cache.block_table
    for row in ids:  # benchmark only: as if `context` tokens had been prefilled
        blocks = table.new_blocks(-(-context // bs))
        table.table[row, : len(blocks)] = blocks
        table.n_blocks[row], table.lengths[row] = len(blocks), context
    return cache, ids, step


def _against_sdpa(measure: Callable[[], tuple[torch.Tensor, float, float]]) -> dict:
    """`measure()` (a cache built and decoded from the seed: the first call's logits, its seconds (capture and
    compilation), then tokens/s) through SDPA, then through FlexAttention, back to back from the same seed; their
    rates and first logits compared."""
    results = {}
    chosen = flex.SERVES
    try:
        for kernel in ("sdpa", "flex"):
            flex.SERVES = kernel == "flex"
            torch.manual_seed(0)
            results[kernel] = measure()
    finally:
        flex.SERVES = chosen
    (sdpa, sdpa_first_s, sdpa_rate), (got, flex_first_s, flex_rate) = results["sdpa"], results["flex"]
    agree = (got.argmax(-1) == sdpa.argmax(-1)).float().mean().item()
    return {"sdpa_tokens_per_s": sdpa_rate, "flex_tokens_per_s": flex_rate, "flex_over_sdpa": flex_rate / sdpa_rate,
            "max_abs": (got - sdpa).abs().max().item(), "top1_agreement": agree,
            "sdpa_first_step_s": sdpa_first_s, "flex_first_step_s": flex_first_s}


def compare(net, device: str, policy: str, budget: int | None, rows: int, context: int, steps: int,
            static: bool) -> dict:
    """Tokens/s of `steps` greedy one-token steps through SDPA, then through FlexAttention, each from an equal cache
    after one warm-up step, whose logits are compared (`_against_sdpa`)."""
    def measure():
        cache, ids, step = _cache(net, policy, budget, rows, context, steps, static)
        tokens = torch.randint(0, net.args.vocab_size, (rows,), device=device)

        def decode(tokens: torch.Tensor) -> torch.Tensor:
            return step(ids, tokens) if step is not None else net.decode(tokens, cache, ids)

        with torch.inference_mode():
            start = time.perf_counter()
            first = decode(tokens).float()
            tokens = first.argmax(-1)
            sync(device)
            warm_up = time.perf_counter() - start
            start = time.perf_counter()
            for _ in range(steps):
                tokens = decode(tokens).argmax(-1)
            sync(device)
        return first, warm_up, rows * steps / (time.perf_counter() - start)

    return _against_sdpa(measure)


def compare_forward(net, device: str, rows: int, context: int, tokens: int, repeats: int) -> dict:
    """Tokens/s of forwards of `tokens` new tokens a row over `context` cached ones (the PRM's scoring shape: each
    row's candidate read as a suffix of its cached prefix), through SDPA (each row's blocks gathered), then through
    FlexAttention (read in place), each from an equal full cache: one forward (compilation) whose last logits are
    compared, then `repeats` more timed."""
    def measure():
        cache, ids, _ = _cache(net, "none", None, rows, context, (repeats + 1) * tokens, static=False)
        new = torch.randint(0, net.args.vocab_size, (rows, tokens), device=device)
        with torch.inference_mode():
            start = time.perf_counter()
            first = net.prefill(new, cache, ids, [tokens] * rows).float()
            sync(device)
            warm_up = time.perf_counter() - start
            start = time.perf_counter()
            for _ in range(repeats):
                net.prefill(new, cache, ids, [tokens] * rows)
            sync(device)
        return first, warm_up, rows * tokens * repeats / (time.perf_counter() - start)

    return _against_sdpa(measure)


def flex_section(check: Check, device: str, dtype: torch.dtype, tiny: bool, plan: dict) -> None:
    """Every shape's pair, each recorded as it ends; the model is built at the first."""
    if flex.flex_attention is None:
        check.add("flex", {"skipped": f"torch {torch.__version__} has no FlexAttention"})
        return
    shape = TINY if tiny else QWEN25_MATH_7B
    built: dict = {}

    def net():
        if not built:
            hf = hf_model(shape, device, dtype, seed=3)
            built["net"] = build_network(dict(hf.state_dict()), {**hf.config.to_dict(), "model_type": "qwen2"}, dtype, device)
        return built["net"]

    head_dim = shape["hidden_size"] // shape["num_attention_heads"]
    entry = 2 * shape["num_hidden_layers"] * shape["num_key_value_heads"] * head_dim * dtype.itemsize
    context = plan["contexts"][0] if tiny else FULL_CONTEXT
    caches = [("rkv", b, static) for b in plan["budgets"] for static in (False, True)]
    caches += [("none", None, False), ("none", None, True)]
    deadline = check.deadline(DECODE_SHARE)
    for rows in plan["rows"][:1] if tiny else plan["rows"]:  # on a CPU, once: the eager reference is slow
        for policy, budget, static in caches:
            record = {"rows": rows, "context": context, "evictor": policy, "budget": budget,
                      "step": "static" if static else "eager", "cuda_graphs": static and device.startswith("cuda")}
            held = context + plan["steps"] + 1 if policy == "none" else budget + 128
            check.measure("flex", record, deadline, lambda: compare(net(), device, policy, budget, rows, context,
                                                                    plan["steps"], static),
                          too_big(device, 2 * rows * held * entry))
    tokens, repeats = (plan["steps"], 1) if tiny else (FORWARD_TOKENS, FORWARD_REPEATS)
    for rows in plan["rows"][:1] if tiny else FORWARD_ROWS:
        for context in plan["contexts"][:1] if tiny else FORWARD_CONTEXTS:
            record = {"rows": rows, "context": context, "evictor": "none", "budget": None, "step": "forward",
                      "tokens": tokens, "cuda_graphs": False}
            held = context + (repeats + 1) * tokens
            check.measure("flex", record, deadline, lambda: compare_forward(net(), device, rows, context, tokens,
                                                                            repeats),
                          too_big(device, 2 * rows * held * entry))
