"""One-call GPU check: engine logits vs transformers, decode tokens/s, vs vLLM, problems/min, and the roofline.

    python benchmarks/gpu_check.py --out gpu_check.json --budget-s 150   # a lent GPU: about 3 minutes
    python benchmarks/gpu_check.py --tiny --out /tmp/check.json          # the CPU, tiny shapes

Every model has random weights in the shape of a real one (the config values below; nothing is
downloaded). Sections, in this order:
- `roofline`: the measured device-to-device copy bandwidth.
- `logits`: this engine vs transformers on a random Qwen2.5-0.5B-shaped Qwen2, in the run's dtype: a
  plain forward, and a prefill plus one-token decode steps through the static (CUDA-graph) path of the
  bounded cache (rkv with a budget beyond the sequence, so every token stays cached); max/mean |difference|, cosine, top-1 agreement and `ok` under the dtype's tolerance.
- `attention`: the full cache's attention at the helper's shape (Qwen2.5-Math-1.5B, 28 layers), gather vs
  paged vs cascade, decode step time and KV bytes read, context 1k/2k/4k, 8 and 64 problems x N = 8
  (`benchmarks/attention_bench.py`).
- `decode`: tokens/s of one-token decode steps with Qwen2.5-Math-7B's shape, rows 64/256/512, rkv at
  budgets 64 and 512 with and without CUDA graphs and `none` (the full cache, which has no CUDA-graph
  step), context 1k and 4k, and transformers `generate` at the same rows and context. Both sides do the same work per token: a forward, fp32
  logits, and top-k/top-p sampling at the paper's settings (this engine also pays its entropy). Each
  with its memory-bandwidth roofline (bytes a step must read over the measured copy bandwidth) and the
  share of it reached. Shapes that don't fit in memory are listed with the reason.
- `vllm`: this engine vs vLLM as benchmarks/vs_vllm.py compares them (its functions), in the 7B shapes with
  random weights (vLLM's own, load_format "dummy"), same dtype: decode tokens/s at batch 1/8/32 (the Runner
  vs `generate` with `ignore_eos`, 64 new tokens) and PRM candidates scored per second (PRMScorer vs
  VLLMPRMScorer, 4 problems x 4 steps x 8 candidates), each with engine / vLLM. vLLM gets VLLM_MEMORY of
  the device; it runs in a child process (`--vllm-child`). Where vLLM is not importable every record
  says so (skipped, with the install hint).
- `problems`: problems/min of bon and kvrescue with and without CUDA graphs, and full (which never
  uses them), through `kvrescue run`'s decode code, N = 8, B = 64, random 7B/1.5B/PRM-7B-shaped
  models, synthetic steps, after one warm-up problem.
- `tp` (two or more GPUs only): benchmarks/tp_check.py, tensor parallelism over GPUs 0 and 1.

Time: every measurement is bounded by `--budget-s` (seconds from the start). Measurements not started in
time are recorded as skipped (decode ones past DECODE_SHARE of the budget, vllm ones past VLLM_SHARE, the
others past all of it); a measurement still running at the end of the budget (or, for a problems
measurement, at the end of its equal share of what is left) is interrupted: a problems measurement keeps
the problems that finished and records how many were cut. vLLM's start-up does not stop for an interrupt,
so the vllm section's child process group is ended (SIGTERM, then SIGKILL 10 s later) at VLLM_SHARE of the
budget, keeping the records it finished. Each measurement prints one line as it ends and rewrites the
JSON, so a killed check keeps what it measured; a table of every result ends the run.
"""

from __future__ import annotations

import _thread
import argparse
import gc
import json
import math
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np
import torch

from kvrescue_cli.data import Problem, ProblemSet
from kvrescue_cli.decoding import decode
from kvrescue_cli.engine.bounded import BoundedCache
from kvrescue_cli.engine.caches import FullCache
from kvrescue_cli.engine.evict import MIN_BUDGET
from kvrescue_cli.engine.graphs import StaticDecode, flash_attn_with_kvcache
from kvrescue_cli.engine.loader import LoadedModel, _build
from kvrescue_cli.engine.model import CausalLM, ModelArgs, ProcessRewardModel, Transformer
from kvrescue_cli.random_checkpoints import build_tokenizer
from kvrescue_cli.engine.sampling import SamplingParams, sample
from kvrescue_cli.grid import Cell, GridOptions
from kvrescue_cli.outputs import Trace, installed_version
from kvrescue_cli.search import SearchSettings

# Hugging Face config values (config.json) of the models whose shapes are measured.
QWEN25_05B = dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                  num_attention_heads=14, num_key_value_heads=2, rope_theta=1000000.0, tie_word_embeddings=True)
QWEN25_MATH_7B = dict(vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                      num_attention_heads=28, num_key_value_heads=4, rope_theta=10000.0, tie_word_embeddings=False)
QWEN25_MATH_15B = dict(vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                       num_attention_heads=12, num_key_value_heads=2, rope_theta=10000.0, tie_word_embeddings=True)
QWEN25_MATH_PRM_7B = QWEN25_MATH_7B
TINY = dict(vocab_size=1024, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, rope_theta=10000.0, tie_word_embeddings=False)

# The vLLM section's shapes on the CPU: vLLM's CPU attention takes head sizes from 32 up.
TINY_VLLM = dict(TINY, num_attention_heads=2, num_key_value_heads=1)

FULL = dict(rows=(64, 256, 512), budgets=(64, 512), contexts=(1024, 4096), steps=32, problems=64, n=8, batch=8,
            budget=64, synthetic=(32, 6), logit_tokens=256,
            vllm_batches=(1, 8, 32), vllm_new_tokens=64, vllm_repeats=2, vllm_prm=(4, 4, 8), vllm_kv_mib=512)
SMALL = dict(rows=(4, 8), budgets=(16,), contexts=(64, 160), steps=4, problems=4, n=2, batch=2,
             budget=16, synthetic=(4, 2), logit_tokens=24,
             vllm_batches=(1, 8, 32), vllm_new_tokens=8, vllm_repeats=1, vllm_prm=(2, 2, 2), vllm_kv_mib=64)
DECODE_SHARE = 0.5  # decode measurements start only in the first half of the budget
VLLM_SHARE = 0.75  # vLLM measurements start and end within the first 3/4 of it; problems get the rest
VLLM_MEMORY = 0.4  # vLLM's share of the device (this engine's model and cache take the rest)
PARAMS = SamplingParams()  # the paper's sampling, on both sides of every decode comparison
# (method, CUDA graphs) of the problems section, each pair alternating its order
PROBLEM_RUNS = (("bon", True), ("bon", False), ("full", False), ("kvrescue", False), ("kvrescue", True))


def hf_config(shape: dict, tokenizer=None):
    from transformers import Qwen2Config

    ids = dict(eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id) if tokenizer else {}
    return Qwen2Config(**shape, max_position_embeddings=8192, **ids)


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


# -- the roofline -------------------------------------------------------------------------------------
def copy_bandwidth(device: str, tiny: bool) -> dict:
    """Device-to-device copy bandwidth: bytes read + written per second."""
    n = (64 if tiny else 2048) * 2**20
    src = torch.empty(n, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    seconds = timed(device, lambda: dst.copy_(src), repeat=5)
    return {"bytes": n, "seconds": seconds, "bytes_per_s": 2 * n / seconds}


def roofline(rate: float, rows: int, step_bytes: float, bandwidth: float | None) -> dict:
    """A decode rate next to its bound: every step reads the weights and each row's cached K/V once."""
    bound = rows * bandwidth / step_bytes if bandwidth else None
    return {"tokens_per_s": rate, "step_bytes": step_bytes, "roofline_tokens_per_s": bound,
            "of_roofline": rate / bound if bound else None}


# -- logits -------------------------------------------------------------------------------------------
def check_logits(device: str, dtype: torch.dtype, tiny: bool, plan: dict) -> dict:
    """Engine vs transformers logits: a plain forward, then prefill + static decode steps."""
    shape = TINY if tiny else QWEN25_05B
    hf = hf_model(shape, device, dtype, seed=0)
    net = _build(dict(hf.state_dict()), {**hf.config.to_dict(), "model_type": "qwen2"}, dtype, device)
    tokens = plan["logit_tokens"]
    ids = torch.randint(0, shape["vocab_size"], (2, tokens), device=device, generator=torch.Generator(device).manual_seed(1))
    with torch.inference_mode():
        want = hf(input_ids=ids).logits.float()
        plain = net(ids).float()
        prefix = tokens * 3 // 4
        # a budget beyond the sequence: nothing is evicted, so transformers' full attention is the reference
        cache = BoundedCache.for_model(net, budget=max(tokens, MIN_BUDGET), policy="rkv", max_append=tokens, rows=4)
        rows = [cache.create() for _ in range(2)]
        steps = [net.prefill(ids[:, :prefix], cache, rows, [prefix] * 2).float()]
        decode_step = StaticDecode(net, cache, graphs=device.startswith("cuda"))
        for t in range(prefix, tokens - 1):
            steps.append(decode_step(rows, ids[:, t].tolist()).float())
        assert all(cache.physical_length(r) == cache.length(r) for r in rows), "the check's rows were evicted"
    stepped = torch.stack(steps, dim=1)

    def compare(got: torch.Tensor, ref: torch.Tensor) -> dict:
        diff = (got - ref).abs()
        cos = torch.nn.functional.cosine_similarity(got.flatten(0, -2), ref.flatten(0, -2), dim=-1)
        return {"max_abs": diff.max().item(), "mean_abs": diff.mean().item(), "ref_std": ref.std().item(),
                "min_cosine": cos.min().item(),
                "top1_agreement": (got.argmax(-1) == ref.argmax(-1)).float().mean().item()}

    result = {"shape": "tiny" if tiny else "Qwen2.5-0.5B", "dtype": str(dtype).removeprefix("torch."),
              "tokens": tokens, "forward": compare(plain, want),
              "prefill_then_decode": compare(stepped, want[:, prefix - 1: tokens - 1])}
    if dtype == torch.float32:
        result["tolerance"] = "max_abs <= 1e-3"
        result["ok"] = all(result[k]["max_abs"] <= 1e-3 for k in ("forward", "prefill_then_decode"))
    else:
        result["tolerance"] = "min_cosine >= 0.99 and mean_abs <= 0.05 * ref_std"
        result["ok"] = all(result[k]["min_cosine"] >= 0.99 and result[k]["mean_abs"] <= 0.05 * result[k]["ref_std"]
                           for k in ("forward", "prefill_then_decode"))
    return result


# -- decode tokens/s ----------------------------------------------------------------------------------
def filled_cache(net: Transformer, policy: str, budget: int, rows: int, context: int,
                 steps: int) -> tuple[BoundedCache | FullCache, list[int]]:
    """A cache whose rows look prefilled with `context` tokens (random K/V, no prefill run): an evicting
    row holds between `budget` and B' - 1 entries, staggered so compressions spread as in steady decoding;
    `none` is the full cache `kvrescue run` builds for it, each row holding all `context` tokens."""
    if policy == "none":
        from evict_bench import make_paged_rows  # beside this script

        return make_paged_rows(net, rows, context, steps + 1, candidates=1)  # each row forked from its own prefix
    cache = BoundedCache.for_model(net, budget=budget, policy=policy, max_append=1, rows=rows + 1)
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


def free_bytes(device: str) -> float:
    return torch.cuda.mem_get_info(device)[0] if device.startswith("cuda") else float("inf")


def too_big(device: str, need: float) -> str | None:
    """Why a cache of `need` bytes is not built, or None when it fits."""
    return f"needs {need / 2**30:.0f} GiB of KV cache" if need > 0.8 * free_bytes(device) else None


def attention_section(check: Check, device: str, dtype: torch.dtype, tiny: bool) -> None:
    """The full cache's attention, gather vs paged vs cascade, each shape recorded as it ends."""
    from attention_bench import measure_shape  # beside this script

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
            built["net"] = _build(dict(hf.state_dict()), {**hf.config.to_dict(), "model_type": "qwen2"}, dtype, device)
            built["weight_bytes"] = sum(p.numel() * p.element_size() for p in built["net"].parameters())
        return built["hf"], built["net"], built["weight_bytes"]

    head_dim = shape["hidden_size"] // shape["num_attention_heads"]
    entry = 2 * shape["num_hidden_layers"] * shape["num_key_value_heads"] * head_dim * dtype.itemsize  # K + V bytes
    bandwidth = check.report.get("roofline", {}).get("bytes_per_s")
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
                    if graphs and policy == "none":
                        check.add("decode", {**record, "skipped": "`none` decodes with the full cache, which has no "
                                                                  "CUDA-graph step (as in `kvrescue run`)"})
                        continue
                    check.measure("decode", record, deadline, lambda: roofline(
                        decode_rate(models()[1], device, policy, budget or 64, rows, context, plan["steps"], graphs),
                        rows, models()[2] + rows * mean_read * entry, bandwidth), too_big(device, rows * held * entry))
            record = {"engine": "transformers-generate", "rows": rows, "context": context, "evictor": "none",
                      "budget": None, "cuda_graphs": False}
            need = 2 * rows * (context + plan["steps"]) * entry  # generate's cache grows by concatenation
            mean_read = context + plan["steps"] / 2
            check.measure("decode", record, deadline, lambda: roofline(
                hf_rate(models()[0], device, dtype, rows, context, plan["steps"]), rows,
                models()[2] + rows * mean_read * entry, bandwidth), too_big(device, need))


# -- this engine vs vLLM ------------------------------------------------------------------------------
def vllm_records(dtype: torch.dtype, tiny: bool, plan: dict) -> list[dict]:
    """The vllm section's measurements, in order: decode at each batch size, then PRM scoring."""
    common = {"dtype": str(dtype).removeprefix("torch.")}
    problems, steps, candidates = plan["vllm_prm"]
    return ([{"measure": "decode", "shape": "tiny" if tiny else "Qwen2.5-Math-7B", **common, "batch": batch,
              "new_tokens": plan["vllm_new_tokens"]} for batch in plan["vllm_batches"]]
            + [{"measure": "prm", "shape": "tiny" if tiny else "Qwen2.5-Math-PRM-7B", **common, "problems": problems,
                "steps": steps, "candidates": candidates}])


def vllm_section(check: Check, device: str, dtype: torch.dtype, tiny: bool, plan: dict) -> None:
    """This engine vs vLLM (`vllm_child`), in a child process of its own session: vLLM's start-up does not stop
    for an interrupt, so the child's whole process group is ended at VLLM_SHARE of the budget, keeping the
    records it wrote. Where vLLM is not importable, every record says so."""
    from kvrescue_cli.errors import InputError
    from kvrescue_cli.vllm_engine import require_vllm

    records = vllm_records(dtype, tiny, plan)
    try:
        require_vllm("gpu_check's vllm section")
    except InputError as err:
        for record in records:
            check.add("vllm", {**record, "skipped": str(err)})
        return
    end = check.deadline(VLLM_SHARE)
    gc.collect()  # what earlier sections cached goes back to the device, where vLLM takes its share from
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    with tempfile.TemporaryDirectory(prefix="gpu_check-vllm-") as scratch:
        lines = Path(scratch) / "records.jsonl"
        lines.touch()
        child, received = None, 0
        first = rest = None  # why the first record not received is missing, and why the others are
        if time.perf_counter() < end:
            child = subprocess.Popen([sys.executable, __file__, "--vllm-child", str(lines), "--device", device]
                                     + (["--tiny"] if tiny else []), start_new_session=True)
        try:
            while child is not None:
                exited = child.poll() is not None
                for line in lines.read_text().split("\n")[received:-1]:  # complete lines only
                    check.add("vllm", json.loads(line))
                    received += 1
                if exited:
                    first = f"failed: the measuring process exited with status {child.returncode}"
                    rest = "not started: the measuring process had exited"
                    break
                if time.perf_counter() > end:
                    first = f"interrupted {end - check.started:.0f} s into the {check.budget_s:.0f} s budget"
                    break
                time.sleep(0.5)
        finally:
            if child is not None:
                end_process_group(child)
        for i, record in enumerate(records[received:]):
            check.add("vllm", {**record, "skipped": (first if i == 0 else rest) or check.late()})


def end_process_group(process: subprocess.Popen) -> None:
    """SIGTERM to the process's group (vLLM's engine shuts down on it), SIGKILL to any member left 10 s later."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            return
        waited = time.perf_counter() + 10
        while time.perf_counter() < waited:
            process.poll()  # reaps the leader once it has ended
            try:
                os.killpg(process.pid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.2)


def vllm_child(out: Path, device: str, dtype: torch.dtype, tiny: bool, plan: dict) -> None:
    """`--vllm-child OUT`: benchmarks/vs_vllm.py's decode and PRM comparisons in the 7B shapes, each record appended
    to `out` as one JSON line as it ends: decode tokens/s of this engine's Runner vs vLLM `generate` with
    `ignore_eos` at each batch, PRM candidates/s of PRMScorer vs VLLMPRMScorer; the same random shape and dtype
    on both sides (vLLM's own random weights, load_format "dummy"). One vLLM engine at a time."""
    from vs_vllm import best_of_interleaved, chat_prompt, decode_measures, prm_measures, prm_workload, vllm_memory

    from kvrescue_cli.vllm_engine import require_vllm
    from kvrescue_cli.vllm_engine.llm import start_llm

    vllm = require_vllm("gpu_check's vllm section")
    check = RecordLines(out)
    shapes = {"base": TINY_VLLM if tiny else QWEN25_MATH_7B, "prm": TINY_VLLM if tiny else QWEN25_MATH_PRM_7B}
    *decode_records, prm_record = vllm_records(dtype, tiny, plan)
    new, repeats, (problems, steps, candidates) = plan["vllm_new_tokens"], plan["vllm_repeats"], plan["vllm_prm"]
    tokenizer = build_tokenizer(512)
    scratch = Path(tempfile.mkdtemp(prefix="gpu_check-vllm-models-"))
    engines: list = []  # the vLLM engine running now

    def started(role: str, architecture: str, **settings) -> Any:
        engines.append(start_llm(vllm_folder(scratch / role, shapes[role], tokenizer, architecture),
                                 dtype=str(dtype).removeprefix("torch."), load_format="dummy",
                                 **vllm_memory(device, VLLM_MEMORY, plan["vllm_kv_mib"]), **settings))
        return engines[-1]

    def stop() -> None:
        for llm in engines:
            llm.llm_engine.engine_core.shutdown()
        engines.clear()

    def ratio(ours: float, theirs: float, unit: str) -> dict:
        return {f"engine_{unit}": ours, f"vllm_{unit}": theirs, "engine_over_vllm": ours / theirs}

    built: dict[str, Any] = {}

    def decoding():  # at the first decode measurement: vLLM first, this engine's model in what it leaves
        if built.get("measures") is None:
            if built:
                raise RuntimeError("the first decode measurement did not get both engines ready")
            built["measures"] = None
            prompt = chat_prompt(tokenizer)
            llm = started("base", "Qwen2ForCausalLM", max_model_len=len(prompt) + new + 64)
            model = random_loaded(shapes["base"], device, dtype, 20, tokenizer, "base")
            built["measures"] = decode_measures(model, llm, vllm, prompt, plan["vllm_batches"], new)
        return built["measures"]

    def scoring() -> dict:
        llm = started("prm", "Qwen2ForProcessRewardModel", max_model_len=4096, runner="pooling")
        prm = random_loaded(shapes["prm"], device, dtype, 21, tokenizer, "prm")
        measures, tokens = prm_measures(prm, llm, prm_workload(problems, steps, candidates))
        return {**ratio(*best_of_interleaved(measures, repeats), "candidates_per_s"), "engine_tokens": tokens[0],
                "vllm_tokens": tokens[1]}

    try:
        for record in decode_records:
            check.measure("vllm", record, math.inf, lambda: ratio(
                *best_of_interleaved(decoding(), repeats, record["batch"]), "tokens_per_s"), interrupt=False)
        built.clear()
        stop()
        check.measure("vllm", prm_record, math.inf, scoring, interrupt=False)
    finally:
        stop()
        shutil.rmtree(scratch, ignore_errors=True)


def vllm_folder(folder: Path, shape: dict, tokenizer, architecture: str) -> Path:
    """A model folder vLLM starts on with random weights (load_format "dummy"): `shape`'s config.json and the
    tokenizer, no weights."""
    config = hf_config(shape, tokenizer)
    config.architectures = [architecture]
    config.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


# -- problems/min -------------------------------------------------------------------------------------
def problems_rate(options: GridOptions, models: dict[str, LoadedModel], problems: ProblemSet, method: str,
                  plan: dict, stop_at: float) -> dict:
    """Problems/min of one method over `problems` (pulled as slots free up), until all are done or `stop_at`."""
    cell = Cell(problems, method, None if method == "full" else plan["budget"], plan["n"], 0)
    finished: list[tuple[Trace, float]] = []
    start = time.perf_counter()
    with interrupted_at(stop_at) as cut:
        decode(options, cell, models, iter(problems.problems),
               lambda trace, _: finished.append((trace, time.perf_counter())))
    result: dict[str, Any] = {"problems": len(finished), "batch": options.settings.batch,
                              "cut": cut(), "cut_after_s": time.perf_counter() - start if cut() else None}
    if not finished:
        return {**result, "skipped": f"no problem finished in {time.perf_counter() - start:.0f} s"}
    seconds = finished[-1][1] - start
    traces = [t for t, _ in finished]
    return {**result, "seconds": seconds, "problems_per_min": len(finished) * 60 / seconds,
            "base_tokens_per_problem": sum(t.tokens.base for t in traces) / len(traces),
            "helper_tokens_per_problem": sum(t.tokens.helper for t in traces) / len(traces),
            "peak_base_rows": max(t.peak_base_rows for t in traces)}


def problems_section(check: Check, device: str, dtype: torch.dtype, tiny: bool, plan: dict) -> None:
    """problems/min of bon and kvrescue with and without CUDA graphs, and full, after a warm-up problem."""
    tokenizer = build_tokenizer(512)
    shapes = {"base": TINY if tiny else QWEN25_MATH_7B, "helper": TINY if tiny else QWEN25_MATH_15B,
              "prm": TINY if tiny else QWEN25_MATH_PRM_7B}
    built: dict[str, LoadedModel] = {}

    def models() -> dict[str, LoadedModel]:
        for seed, (role, shape) in enumerate(shapes.items()):
            if role not in built:
                built[role] = random_loaded(shape, device, dtype, 10 + seed, tokenizer, role)
        return built

    problems = [Problem(i, f"What is {i} + {2 * i}? Let x be the answer.", str(3 * i), {}) for i in range(plan["problems"])]
    problem_set = ProblemSet("synthetic", "generic", "gpu_check", problems)
    settings = SearchSettings(sampling=PARAMS, batch=plan["batch"], synthetic_steps=plan["synthetic"],
                              max_step_tokens=plan["synthetic"][0], context_cap=4096)
    options = GridOptions(benches=["synthetic"], methods=["bon", "kvrescue", "full"], budgets=[plan["budget"]],
                          ns=[plan["n"]], seeds=[0], evictor="rkv", models={r: f"random-{r}" for r in shapes},
                          scorer="prm", settings=settings, out=Path("unused"), devices=(device,),
                          dtype=str(dtype).removeprefix("torch."))
    end = check.deadline(1.0)
    warm = replace(options, settings=replace(settings, synthetic_steps=(plan["synthetic"][0], 1)))
    check.measure("problems", {"method": "kvrescue", "cuda_graphs": False, "warm_up": True}, end, lambda: problems_rate(
        warm, models(), replace(problem_set, problems=problems[:1]), "kvrescue", plan, end), interrupt=False)
    for i, (method, graphs) in enumerate(PROBLEM_RUNS):
        record = {"method": method, "cuda_graphs": graphs, "n": plan["n"],
                  "budget": None if method == "full" else plan["budget"], "synthetic_steps": list(plan["synthetic"])}
        if graphs and not device.startswith("cuda"):
            check.add("problems", {**record, "skipped": "CUDA graphs need a GPU"})
            continue
        share = time.perf_counter() + (end - time.perf_counter()) / (len(PROBLEM_RUNS) - i)
        check.measure("problems", record, end, lambda: problems_rate(
            replace(options, cuda_graphs=graphs), models(), problem_set, method, plan, share), interrupt=False)


# -- recording ----------------------------------------------------------------------------------------
@contextmanager
def interrupted_at(deadline: float | None) -> Iterator[Callable[[], bool]]:
    """Run the body until `deadline` (None: no limit) at most: then it is interrupted (KeyboardInterrupt in
    this thread) and the context ends normally; the yielded function tells whether that happened. A real
    Ctrl-C propagates. The interrupt comes through SIGUSR1's slot, not SIGINT's: a job started in the
    background (`&`, nohup) ignores SIGINT, and `interrupt_main` does nothing for an ignored signal."""
    lock, state = threading.Lock(), {"done": False, "fired": False}

    def fire() -> None:
        with lock:
            if not state["done"]:
                state["fired"] = True
                _thread.interrupt_main(signal.SIGUSR1)

    def on_deadline(signum: int, frame) -> None:
        raise KeyboardInterrupt

    timer = threading.Timer(max(0.0, deadline - time.perf_counter()), fire) if deadline is not None else None
    previous = signal.signal(signal.SIGUSR1, on_deadline) if timer is not None else None
    if timer is not None:
        timer.start()
    try:
        yield lambda: state["fired"]
        with lock:
            state["done"] = True
    except KeyboardInterrupt:
        with lock:
            state["done"] = True
        if not state["fired"]:
            raise
    finally:
        if timer is not None:
            timer.cancel()
            signal.signal(signal.SIGUSR1, previous)


class Check:
    """The report being measured: each measurement is recorded, printed and written as soon as it ends."""

    def __init__(self, out: Path, report: dict, budget_s: float) -> None:
        self.out, self.report, self.budget_s = out, report, budget_s
        self.started = time.perf_counter()

    def deadline(self, share: float) -> float:
        """The time by which `share` of the budget has passed."""
        return self.started + share * self.budget_s

    def measure(self, section: str, record: dict, start_by: float, fn: Callable[[], dict],
                skip: str | None = None, interrupt: bool = True) -> None:
        """Record `record` with what `fn` measured, or with why it was skipped (`skip`, or past `start_by`).
        `fn` is interrupted at the end of the budget unless it bounds itself (`interrupt` False); an error
        is recorded, not raised."""
        now = time.perf_counter()
        if skip is None and now > start_by:
            skip = self.late()
        if skip is not None:
            self.add(section, {**record, "skipped": skip})
            return
        result: dict = {}
        try:
            with interrupted_at(self.deadline(1.0) if interrupt else None) as cut:
                result = fn()
            if cut() and not result:
                result = {"skipped": f"interrupted at the end of the {self.budget_s:.0f} s budget"}
        except Exception as err:  # noqa: BLE001 - one failed measurement must not cost the others
            traceback.print_exc()
            result = {"skipped": f"failed: {type(err).__name__}: {err}"[:300]}
        finally:
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        self.add(section, {**record, **result, "seconds_taken": time.perf_counter() - now})

    def late(self) -> str:
        """Why a measurement was not started."""
        return f"not started: {time.perf_counter() - self.started:.0f} s of the {self.budget_s:.0f} s budget had passed"

    def add(self, section: str, record: dict) -> None:
        """Keep one result (a list entry, or the section itself for roofline and logits), write, print."""
        if section in ("roofline", "logits"):
            self.report[section] = record
        else:
            self.report.setdefault(section, []).append(record)
        self.report["elapsed_s"] = time.perf_counter() - self.started
        self.out.write_text(json.dumps(self.report, indent=2) + "\n")
        print(f"[{self.report['elapsed_s']:6.1f} s] {section}: {describe(section, record)}", flush=True)


class RecordLines(Check):
    """The vllm child's records: each appended to `out` as one JSON line as it ends (no budget: its parent ends it)."""

    def __init__(self, out: Path) -> None:
        super().__init__(out, {}, math.inf)

    def add(self, section: str, record: dict) -> None:
        with self.out.open("a") as lines:
            lines.write(json.dumps(record) + "\n")


def describe(section: str, r: dict) -> str:
    """One line for one result."""
    if section == "tp":
        from tp_check import describe as describe_tp  # benchmarks/, next to this script
        return describe_tp(r)
    if section == "roofline":
        what = "copy bandwidth"
    elif section == "logits":
        what = f"{r.get('shape', '')} {r.get('dtype', '')}"
    elif section == "attention":
        what = f"full-cache attention ctx={r['context']} problems={r['problems']}"
    elif section == "vllm":
        what = (f"engine vs vLLM decode {r['shape']} batch={r['batch']}" if r["measure"] == "decode" else
                f"engine vs vLLM PRM {r['shape']} {r['problems']}x{r['steps']}x{r['candidates']} candidates")
    elif section == "decode":
        budget = f" B={r['budget']}" if r["budget"] else ""
        what = (f"{r['engine']} rows={r['rows']} ctx={r['context']} {r['evictor']}{budget}"
                f" graphs={'on' if r['cuda_graphs'] else 'off'}")
    else:
        budget = f" B={r['budget']}" if r.get("budget") else ""
        what = f"{r['method']}{budget} graphs={'on' if r['cuda_graphs'] else 'off'}{' (warm-up)' if r.get('warm_up') else ''}"
    if "skipped" in r:
        return f"{what}: skipped ({r['skipped']})"
    if section == "roofline":
        return f"{what}: {r['bytes_per_s'] / 1e9:.1f} GB/s"
    if section == "logits":
        return (f"{what}: ok={r['ok']} forward max|d|={r['forward']['max_abs']:.2e} top1={r['forward']['top1_agreement']:.3f}, "
                f"decode max|d|={r['prefill_then_decode']['max_abs']:.2e} top1={r['prefill_then_decode']['top1_agreement']:.3f}")
    if section == "attention":
        return f"{what}: " + ", ".join(f"{v} skipped" if "skipped" in r[v] else
                                       f"{v} {r[v]['step_ms']:.1f} ms/step {r[v]['kv_bytes_read'] / 1e9:.2f} GB"
                                       for v in ("gather", "paged", "cascade"))
    if section == "vllm":
        unit = "tokens_per_s" if r["measure"] == "decode" else "candidates_per_s"
        return (f"{what}: {r[f'engine_{unit}']:.1f} vs {r[f'vllm_{unit}']:.1f} {unit.replace('_per_s', '/s')} "
                f"(engine / vLLM {r['engine_over_vllm']:.2f})")
    if section == "decode":
        share = f" ({100 * r['of_roofline']:.1f}% of roofline)" if r["of_roofline"] is not None else ""
        return f"{what}: {r['tokens_per_s']:.1f} tok/s{share}"
    cut = f", {r['problems']} finished before the cut" if r["cut"] else ""
    return f"{what}: {r['problems']} problems in {r['seconds']:.1f} s = {r['problems_per_min']:.2f}/min{cut}"


def table(report: dict) -> str:
    """Every result, one line each, grouped by section."""
    lines = ["", f"gpu_check on {report['device']} ({report['dtype']}), {report.get('elapsed_s', 0):.0f} s:"]
    for section in ("roofline", "logits", "attention", "decode", "vllm", "problems", "tp"):
        found = report.get(section)
        if found is None:
            continue
        lines.append(f"  {section}")
        lines += [f"    {describe(section, r)}" for r in (found if isinstance(found, list) else [found])]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiny", action="store_true", help="tiny shapes on the CPU, end to end in well under a minute")
    parser.add_argument("--device", default=None, help="default: cuda when available, else cpu (always cpu with --tiny)")
    parser.add_argument("--out", type=Path, default=Path("gpu_check.json"))
    parser.add_argument("--skip", default="",
                        help="comma list of sections to leave out: logits,attention,decode,vllm,problems,tp")
    parser.add_argument("--budget-s", type=float, default=150.0,
                        help="seconds from the start within which every measurement starts and ends (see the top)")
    parser.add_argument("--vllm-child", type=Path, default=None, metavar="OUT",
                        help="only measure the vllm section, appending its records to OUT as JSON lines (the section "
                             "runs so in a child process, which ends at its share of the budget)")
    args = parser.parse_args()
    device = "cpu" if args.tiny else args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    if device.startswith("cuda"):
        torch.cuda.set_device(device)  # cuda:N: graphs, streams and every default-device call on GPU N, not 0
    plan = SMALL if args.tiny else FULL
    if args.vllm_child is not None:
        vllm_child(args.vllm_child, device, dtype, args.tiny, plan)
        return
    skip = set(filter(None, args.skip.split(",")))
    report: dict = {"device": torch.cuda.get_device_name(device) if device.startswith("cuda") else platform.processor() or "cpu",
                    "torch": torch.__version__, "tiny": args.tiny, "dtype": str(dtype).removeprefix("torch."),
                    "flash_attn": flash_attn_with_kvcache is not None, "vllm_version": installed_version("vllm"),
                    "budget_s": args.budget_s}
    check = Check(args.out, report, args.budget_s)
    end = check.deadline(1.0)
    check.measure("roofline", {}, end, lambda: copy_bandwidth(device, args.tiny))
    if "logits" not in skip:
        check.measure("logits", {}, end, lambda: check_logits(device, dtype, args.tiny, plan))
    if "attention" not in skip:
        attention_section(check, device, dtype, args.tiny)
    if "decode" not in skip:
        decode_section(check, device, dtype, args.tiny, plan)
    if "vllm" not in skip:
        vllm_section(check, device, dtype, args.tiny, plan)
    if "problems" not in skip:
        problems_section(check, device, dtype, args.tiny, plan)
    if "tp" not in skip and device.startswith("cuda") and torch.cuda.device_count() >= 2:
        from tp_check import tp_section
        check.measure("tp", {}, end, lambda: tp_section(tiny=False, timeout_s=max(end - time.perf_counter(), 1.0)),
                      interrupt=False)
    print(table(report), flush=True)
    print(f"wrote {args.out} in {time.perf_counter() - check.started:.1f} s", flush=True)


if __name__ == "__main__":
    main()
