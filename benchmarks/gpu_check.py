"""One-call GPU check: engine logits vs transformers, decode tokens/s, problems/min, and the roofline.

    python benchmarks/gpu_check.py --out gpu_check.json          # a lent GPU, under 8 minutes
    python benchmarks/gpu_check.py --tiny --out /tmp/check.json   # the CPU, tiny shapes, well under a minute

Every model has random weights in the shape of a real one (the config values below; nothing is
downloaded). Writes one JSON object:
- `logits`: this engine vs transformers on a random Qwen2.5-0.5B-shaped Qwen2, in the run's dtype: a
  plain forward, and a prefill plus one-token decode steps through the static (CUDA-graph) path of the
  bounded cache; max/mean |difference|, cosine, top-1 agreement and `ok` under the dtype's tolerance.
- `decode`: tokens/s of one-token decode steps with Qwen2.5-Math-7B's shape, rows 64/256/512, rkv at
  budgets 64 and 512 and `none`, context 1k and 4k, with and without CUDA graphs, and transformers
  `generate` at the same rows and context; each with its memory-bandwidth roofline (bytes a step must
  read over the measured copy bandwidth) and the share of it reached. Shapes that don't fit in memory
  are listed with the reason.
- `problems`: problems/min of bon, kvrescue and full (`kvrescue run`'s code path) on 64 problems, N = 8,
  B = 64, random 7B/1.5B/PRM-7B-shaped models, synthetic steps 32:20.
- `roofline`: the measured device-to-device copy bandwidth.
Sections run in that order but (2) last: its measurements not started within `--budget-s` (450 s) of the
start are listed as skipped, so the check ends in under 8 minutes; each section is written as it ends.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import time
from pathlib import Path

import torch

from kvrescue_cli.data import Problem, ProblemSet
from kvrescue_cli.engine.bounded import BoundedCache
from kvrescue_cli.engine.graphs import SPAN_STEP, StaticDecode, flash_attn_with_kvcache
from kvrescue_cli.engine.loader import LoadedModel, _build
from kvrescue_cli.engine.model import CausalLM, ModelArgs, ProcessRewardModel, Transformer
from kvrescue_cli.engine.random_checkpoints import build_tokenizer
from kvrescue_cli.engine.sampling import SamplingParams
from kvrescue_cli.runs import Cell, GridOptions, run_cell
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

FULL = dict(rows=(64, 256, 512), budgets=(64, 512), contexts=(1024, 4096), steps=32, problems=64, n=8, batch=64,
            synthetic=(32, 20), logit_tokens=256)
SMALL = dict(rows=(4, 8), budgets=(16,), contexts=(64, 160), steps=4, problems=4, n=2, batch=2,
             synthetic=(4, 2), logit_tokens=24)


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


# -- (4) the roofline ---------------------------------------------------------------------------------
def copy_bandwidth(device: str, tiny: bool) -> dict:
    """Device-to-device copy bandwidth: bytes read + written per second."""
    n = (64 if tiny else 2048) * 2**20
    src = torch.empty(n, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    seconds = timed(device, lambda: dst.copy_(src), repeat=5)
    return {"bytes": n, "seconds": seconds, "bytes_per_s": 2 * n / seconds}


# -- (1) logits ---------------------------------------------------------------------------------------
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
        cache = BoundedCache.for_model(net, budget=64, policy="none", max_append=tokens, rows=4)
        rows = [cache.create() for _ in range(2)]
        steps = [net.prefill(ids[:, :prefix], cache, rows, [prefix] * 2).float()]
        decode = StaticDecode(net, cache, graphs=device.startswith("cuda"))
        for t in range(prefix, tokens - 1):
            steps.append(decode(rows, ids[:, t].tolist()).float())
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


# -- (2) decode tokens/s ------------------------------------------------------------------------------
def filled_cache(net: Transformer, policy: str, budget: int, rows: int, context: int, steps: int) -> tuple[BoundedCache, list[int]]:
    """A cache whose rows look prefilled with `context` tokens (random K/V, no prefill run): an evicting
    row holds between `budget` and B' - 1 entries, staggered so compressions spread as in steady decoding."""
    capacity = -(-(context + steps + 1) // SPAN_STEP) * SPAN_STEP if policy == "none" else None  # the static span fits
    cache = BoundedCache.for_model(net, budget=budget, policy=policy, max_append=1, rows=rows + 1, capacity=capacity)
    cache.k.normal_()
    cache.v.normal_()
    cache.q.normal_()
    ids = [cache.create() for _ in range(rows)]
    span = cache.trigger - budget
    for i, row in enumerate(ids):
        physical = context if policy == "none" else budget + (i * span) // rows
        state = cache.rows[row]  # benchmark only: lengths as if `context` tokens had been prefilled
        state.physical, state.logical, state.peak = physical, context, physical
    return cache, ids


def decode_rate(net: Transformer, device: str, policy: str, budget: int, rows: int, context: int, steps: int,
                graphs: bool) -> float:
    """Tokens/s of `steps` one-token decode steps over `rows` rows."""
    cache, ids = filled_cache(net, policy, budget, rows, context, steps)
    tokens = torch.randint(0, net.args.vocab_size, (rows,)).tolist()
    if graphs:
        step = StaticDecode(net, cache, graphs=True)
        run = lambda: step(ids, tokens)  # noqa: E731
    else:
        batch = torch.tensor(tokens, device=device)
        run = lambda: net.decode(batch, cache, ids)  # noqa: E731
    with torch.inference_mode():
        run()  # warm-up (and capture)
        sync(device)
        start = time.perf_counter()
        for _ in range(steps):
            run()
        sync(device)
    return rows * steps / (time.perf_counter() - start)


def hf_rate(hf, device: str, dtype: torch.dtype, rows: int, context: int, steps: int) -> float:
    """Tokens/s of transformers `generate` (greedy, `steps` new tokens) over a cache prefilled with random K/V."""
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
                    min_new_tokens=steps, do_sample=False, pad_token_id=0)

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


def skip_reason(device: str, need: float, deadline: float) -> str | None:
    """Why a decode measurement is not taken: past the check's time budget, or a cache that would not fit."""
    if time.perf_counter() > deadline:
        return "out of the check's time budget"
    if need > 0.8 * free_bytes(device):
        return f"needs {need / 2**30:.0f} GiB of KV cache"
    return None


def measure_decode(device: str, dtype: torch.dtype, tiny: bool, plan: dict, bandwidth: float,
                   deadline: float) -> list[dict]:
    """Every decode configuration of (2), with its roofline; those not started by `deadline` are listed as skipped."""
    shape = TINY if tiny else QWEN25_MATH_7B
    hf = hf_model(shape, device, dtype, seed=2)
    net = _build(dict(hf.state_dict()), {**hf.config.to_dict(), "model_type": "qwen2"}, dtype, device)
    weight_bytes = sum(p.numel() * p.element_size() for p in net.parameters())
    probe = BoundedCache.for_model(net, budget=plan["budgets"][0], rows=1, max_append=1)
    entry = probe.bytes_per_entry()
    del probe
    caches = [("rkv", b) for b in plan["budgets"]] + [("none", None)]
    results = []
    for rows in plan["rows"]:
        for context in plan["contexts"]:
            for policy, budget in caches:
                held = context + plan["steps"] if policy == "none" else budget + 128
                mean_read = context + plan["steps"] / 2 if policy == "none" else budget + 64
                need = rows * held * entry
                for graphs in (False, True):
                    record = {"engine": "kvrescue", "rows": rows, "context": context, "evictor": policy,
                              "budget": budget, "cuda_graphs": graphs}
                    if graphs and not device.startswith("cuda"):
                        results.append({**record, "skipped": "CUDA graphs need a GPU"})
                        continue
                    if reason := skip_reason(device, need, deadline):
                        results.append({**record, "skipped": reason})
                        continue
                    rate = decode_rate(net, device, policy, budget or 64, rows, context, plan["steps"], graphs)
                    results.append({**record, **roofline(rate, rows, weight_bytes + rows * mean_read * entry, bandwidth)})
                    if device.startswith("cuda"):
                        torch.cuda.empty_cache()
            record = {"engine": "transformers-generate", "rows": rows, "context": context, "evictor": "none",
                      "budget": None, "cuda_graphs": False}
            need = 2 * rows * (context + plan["steps"]) * entry  # generate's cache grows by concatenation
            if reason := skip_reason(device, need, deadline):
                results.append({**record, "skipped": reason})
                continue
            rate = hf_rate(hf, device, dtype, rows, context, plan["steps"])
            mean_read = context + plan["steps"] / 2
            results.append({**record, **roofline(rate, rows, weight_bytes + rows * mean_read * entry, bandwidth)})
    return results


def roofline(rate: float, rows: int, step_bytes: float, bandwidth: float) -> dict:
    """A decode rate next to its bound: every step reads the weights and each row's cached K/V once."""
    bound = rows * bandwidth / step_bytes
    return {"tokens_per_s": rate, "step_bytes": step_bytes, "roofline_tokens_per_s": bound, "of_roofline": rate / bound}


# -- (3) problems/min ---------------------------------------------------------------------------------
def measure_problems(device: str, dtype: torch.dtype, tiny: bool, plan: dict, graphs: bool) -> list[dict]:
    """problems/min of bon, kvrescue and full through `kvrescue run`'s cell code, with synthetic steps."""
    from rich.progress import Progress

    tokenizer = build_tokenizer(512)
    shapes = {"base": TINY if tiny else QWEN25_MATH_7B, "helper": TINY if tiny else QWEN25_MATH_15B,
              "prm": TINY if tiny else QWEN25_MATH_PRM_7B}
    models = {}
    for seed, (role, shape) in enumerate(shapes.items()):
        net = random_engine(shape, device, dtype, seed=10 + seed, prm=role == "prm")
        models[role] = LoadedModel(net, tokenizer, hf_config(shape, tokenizer).to_dict(), f"random-{role}",
                                   [tokenizer.eos_token_id])
    problems = [Problem(i, f"What is {i} + {2 * i}? Let x be the answer.", str(3 * i), {}) for i in range(plan["problems"])]
    problem_set = ProblemSet("synthetic", "generic", "gpu_check", problems)
    settings = SearchSettings(sampling=SamplingParams(), batch=plan["batch"], synthetic_steps=plan["synthetic"],
                              max_step_tokens=plan["synthetic"][0], context_cap=4096)
    results = []
    with tempfile.TemporaryDirectory() as out:
        options = GridOptions(benches=["synthetic"], methods=["bon", "kvrescue", "full"], budgets=[64], ns=[plan["n"]],
                              seeds=[0], evictor="rkv", models={r: f"random-{r}" for r in shapes}, scorer="prm",
                              settings=settings, out=Path(out), devices=(device,), dtype=str(dtype).removeprefix("torch."),
                              cuda_graphs=graphs)
        for method in ("bon", "kvrescue", "full"):
            cell = Cell(problem_set, method, None if method == "full" else 64, plan["n"], 0)
            start = time.perf_counter()
            summary = run_cell(options, cell, models, Progress(disable=True))
            seconds = time.perf_counter() - start
            results.append({"method": method, "problems": summary.problems, "n": plan["n"], "budget": cell.budget,
                            "seconds": seconds, "problems_per_min": summary.problems * 60 / seconds,
                            "base_tokens_per_problem": summary.base_tokens,
                            "helper_tokens_per_problem": summary.helper_tokens, "peak_base_rows": summary.peak_base_rows})
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiny", action="store_true", help="tiny shapes on the CPU, end to end in well under a minute")
    parser.add_argument("--device", default=None, help="default: cuda when available, else cpu (always cpu with --tiny)")
    parser.add_argument("--out", type=Path, default=Path("gpu_check.json"))
    parser.add_argument("--skip", default="", help="comma list of sections to leave out: logits,decode,problems")
    parser.add_argument("--budget-s", type=float, default=450.0,
                        help="decode measurements not started by then (from the start) are listed as skipped")
    args = parser.parse_args()
    device = "cpu" if args.tiny else args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    plan = SMALL if args.tiny else FULL
    skip = set(filter(None, args.skip.split(",")))
    report: dict = {"device": torch.cuda.get_device_name(device) if device.startswith("cuda") else platform.processor() or "cpu",
                    "torch": torch.__version__, "tiny": args.tiny, "dtype": str(dtype).removeprefix("torch."),
                    "flash_attn": flash_attn_with_kvcache is not None, "seconds": {}}
    started = time.perf_counter()

    def section(name: str, fn) -> None:
        if name in skip:
            return
        t = time.perf_counter()
        report[name] = fn()
        report["seconds"][name] = time.perf_counter() - t
        args.out.write_text(json.dumps(report, indent=2) + "\n")  # each section lands even if a later one fails
        print(f"{name}: {report['seconds'][name]:.1f} s", file=sys.stderr)

    section("roofline", lambda: copy_bandwidth(device, args.tiny))
    bandwidth = report["roofline"]["bytes_per_s"]
    section("logits", lambda: check_logits(device, dtype, args.tiny, plan))
    section("problems", lambda: measure_problems(device, dtype, args.tiny, plan, graphs=True))
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    section("decode", lambda: measure_decode(device, dtype, args.tiny, plan, bandwidth, started + args.budget_s))
    report["seconds"]["total"] = time.perf_counter() - started
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out} in {report['seconds']['total']:.1f} s", file=sys.stderr)


if __name__ == "__main__":
    main()
