"""Full-cache attention: the former gather path vs paged vs cascade, per decode step, and end to end.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/speed/attention_bench.py                 # CPU: 1 of 28 layers
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/speed/attention_bench.py --end-to-end    # + `full` runs, N = 8
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/speed/attention_bench.py --deterministic --dtype bfloat16 \
        --contexts 256,512,1024,2048 --problems 1,8 --step 32                        # batch-invariant kernels
    python benchmarks/speed/attention_bench.py --device cuda --layers 28                   # a GPU (gpu_check calls it)

Attention: the helper's shape (Qwen2.5-Math-1.5B: 28 layers, 12 query / 2 KV heads, head dim 128), a
decode step of `problems` x N candidates, each problem's committed prefix of `context` tokens shared by
its candidates, each candidate `--step` tokens into its current step (random K/V written straight into
the cache; no model). On the CPU only `--layers` layers are held (default 1: the pools of 64 problems at
4k would not fit a shared machine 28 times); the step time is begin + 28 x the measured time per layer.
- gather: the former `FullCache.attend` (every row's blocks copied into a tensor padded to the longest
  row, then masked SDPA; `tests/gather_reference.py`);
- paged: `FullCache(cascade=None)`: each row's own blocks through the block table;
- cascade: `FullCache(cascade=ALWAYS_CASCADE, group_cascade_from=0)`: each problem's shared prefix read once for its N
  candidates, merged by lse (by default the cache cascades where the device's cost model says it pays, with
  `--deterministic` a problem from GROUP_CASCADE_FROM of its own).
KV bytes read per step (all 28 layers) are counted from the blocks each variant addresses: gather the
padded [rows, longest row] table, paged and cascade each sequence's blocks (a shared prefix once per
group). flash-attn reads them in place; the torch paths copy what they read (in chunks of
CHUNK_TOKENS), and gather copies the padded table, then SDPA reads the copy again. Variants are timed
round-robin, the fastest of `--repeats` kept, and a variant whose copies would exceed `--max-gib` is
skipped with the reason.

End to end (`--end-to-end`): `full` runs (best-of-N on the full cache, N = 8) of the CPU demo model
(SmolLM2-135M, base and helper-loglik scorer) on the first `--problems-e2e` GSM8K problems, one per
variant (cascade: the default cache, which cascades where its cost model says it pays), wall time
without model loading. Steps are synthetic (`--synthetic-steps`, default 32 tokens x
16 steps), so every variant does the same work whatever it samples.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from kvrescue.cell_runners import CellParts
from kvrescue.engine import invariance
from kvrescue.engine.caches import FullCache, block_size_for
from kvrescue.engine.sampling import SamplingParams
from kvrescue.grid import grid_options
from kvrescue.in_process import InProcessGroup
from kvrescue.runs import prepare_grid, run_cell
from kvrescue.scorers import HELPER_LOGLIK
from kvrescue.search import SearchSettings
from kvrescue.shapes import ALWAYS_CASCADE, CascadeCost, cascade_cost_on, token_kv_bytes
from kvrescue.smollm import smollm2_folder
from tests.gather_reference import gather_attend

HELPER = dict(layers=28, heads=12, kv_heads=2, head_dim=128)  # Qwen2.5-Math-1.5B
VARIANTS = ("gather", "paged", "cascade")


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)


def filled_cache(cascade: CascadeCost | None, problems: int, n: int, context: int, step: int, layers: int, device: str,
                 dtype: torch.dtype) -> tuple[FullCache, list[int]]:
    """Each problem's prefix of `context` tokens, forked into n candidates holding `step` tokens each."""
    bs = block_size_for(torch.empty(0, device=device, dtype=dtype))
    kv_heads, dim = HELPER["kv_heads"], HELPER["head_dim"]
    blocks = problems * (-(-context // bs) + n * (-(-step // bs) + 3))
    cache = FullCache(layers, kv_heads, dim, blocks, max_rows=problems * (n + 1),
                      max_row_tokens=context + step + 2 * bs, block_size=bs, cascade=cascade,
                      group_cascade_from=0, dtype=dtype, device=device)
    generator = torch.Generator(device).manual_seed(0)

    def fill(rows: list[int], tokens: int) -> None:
        cache.begin(rows, [tokens] * len(rows))
        for layer in range(layers):
            k, v = torch.randn(2, len(rows), kv_heads, tokens, dim, generator=generator, device=device, dtype=dtype)
            cache.store(layer, k, v)
        cache.end()

    parents = [cache.create() for _ in range(problems)]
    for start in range(0, problems, 8):  # 8 prefixes at a time bound the random K/V
        fill(parents[start:start + 8], context)
    rows = [child for p in parents for child in cache.fork(p, n)]
    fill(rows, step)
    return cache, rows


def kv_bytes_per_step(variant: str, cache: FullCache, rows: list[int]) -> int:
    """K/V bytes one decode step reads over all of the helper's layers (blocks addressed, counted)."""
    bs = cache.block_size
    block_bytes = 2 * bs * cache.k.shape[3] * cache.k.shape[4] * cache.k.element_size()
    if variant == "gather":
        blocks = len(rows) * max(len(cache.blocks(r)) for r in rows)
    else:
        f = cache.fwd
        blocks = int((-(-(f.own.cached + 1) // bs)).sum())
        if f.shared is not None:
            blocks += int(f.shared.keys.cached.sum()) // bs
    return blocks * block_bytes * HELPER["layers"]


def modelled(cost: CascadeCost, cache: FullCache, rows: list[int], n: int) -> dict:
    """The cost model's times for one layer of the cascading `cache`'s forward in progress (one token a row) and its
    choice: paged reads what cascade reads plus the shared tokens re-read by all but one of each group's n rows. The
    cost both pay alike is left out, so its times fall short of measured ones; their difference is what it predicts."""
    token_bytes = token_kv_bytes(cache.k.shape[3], cache.k.shape[4], cache.k.element_size())
    cascade_bytes = kv_bytes_per_step("cascade", cache, rows) / HELPER["layers"]
    re_read = int(cache.fwd.shared.keys.cached.sum()) * (n - 1) * token_bytes
    return {"paged_ms": 1e3 * (cascade_bytes + re_read) / cost.bytes_per_s,
            "cascade_ms": 1e3 * (cascade_bytes / cost.bytes_per_s + cost.extra_s(len(rows))),
            "re_read_bytes": re_read, "picks": "cascade" if cost.pays(re_read, len(rows)) else "paged"}


def measure_shape(device: str, dtype: torch.dtype, context: int, problems: int, n: int = 8, step: int = 64,
                  layers: int = 1, repeats: int = 5, max_gib: float = 2.0) -> dict:
    """One decode step of `problems` x n candidates at `context`: per variant the time per layer (fastest of
    `repeats`, round-robin, after a warm-up round), begin's time, the step estimate for 28 layers, KV bytes
    read (counted) and the speed-up over gather, or why it was skipped; and the device kind's cost model's times
    and choice (`modelled`) next to the measured choice (the faster of paged and cascade)."""
    heads, dim = HELPER["heads"], HELPER["head_dim"]
    cascade, rows = filled_cache(ALWAYS_CASCADE, problems, n, context, step, layers, device, dtype)
    cached = [cascade.length(r) for r in rows]
    started = time.perf_counter()
    cascade.begin(rows, [1] * len(rows))
    sync(device)
    begin = {"cascade": time.perf_counter() - started}
    counted = {"cascade": kv_bytes_per_step("cascade", cascade, rows)}
    model = modelled(cascade_cost_on(device.startswith("cuda")), cascade, rows, n)
    # gather and paged copy about what they read (gather: the padded table), which bounds the shapes on a CPU.
    token_bytes = 2 * HELPER["kv_heads"] * dim * cascade.k.element_size()
    single = len(rows) * max(len(cascade.blocks(r)) for r in rows) * cascade.block_size * token_bytes
    paged = None
    if single / 2**30 <= max_gib:
        paged, paged_rows = filled_cache(None, problems, n, context, step, layers, device, dtype)
        started = time.perf_counter()
        paged.begin(paged_rows, [1] * len(rows))
        sync(device)
        begin["paged"] = begin["gather"] = time.perf_counter() - started
        counted.update(paged=kv_bytes_per_step("paged", paged, paged_rows),
                       gather=kv_bytes_per_step("gather", paged, paged_rows))
    generator = torch.Generator(device).manual_seed(1)
    q = torch.randn(len(rows), heads, 1, dim, generator=generator, device=device, dtype=dtype)
    k, v = torch.randn(2, len(rows), HELPER["kv_heads"], 1, dim, generator=generator, device=device, dtype=dtype)
    calls = {"cascade": lambda layer: cascade.attend(layer, q, k, v)}
    if paged is not None:
        calls["paged"] = lambda layer: paged.attend(layer, q, k, v)
        calls["gather"] = lambda layer: gather_attend(paged, layer, paged_rows, cached, q)
    best = {name: float("inf") for name in calls}
    for repeat in range(repeats + 1):  # the first round warms up
        for name, call in calls.items():
            sync(device)
            started = time.perf_counter()
            for layer in range(layers):
                call(layer)
            sync(device)
            if repeat:
                best[name] = min(best[name], (time.perf_counter() - started) / layers)
    result: dict = {"context": context, "problems": problems, "n": n, "rows": len(rows), "step_tokens": step,
                    "layers_held": layers, "block_size": cascade.block_size}
    for name in VARIANTS:
        if name not in calls:
            result[name] = {"skipped": f"its copies need {single / 2**30:.1f} GiB > --max-gib {max_gib}"}
            continue
        result[name] = {"ms_per_layer": 1e3 * best[name], "begin_ms": 1e3 * begin[name],
                        "step_ms": 1e3 * (begin[name] + HELPER["layers"] * best[name]),
                        "kv_bytes_read": counted[name]}
        if "gather" in calls:
            result[name]["speedup_vs_gather"] = result["gather"]["step_ms"] / result[name]["step_ms"]
    result["model"] = model
    if "paged" in calls:
        model["measured_faster"] = "cascade" if best["cascade"] < best["paged"] else "paged"
    return result


def end_to_end(limit: int, n: int, synthetic: tuple[int, int]) -> list[dict]:
    """`full` runs of the CPU demo model (N = n) with each variant's cache; wall seconds without loading."""
    class PagedCache(FullCache):
        def __init__(self, *args, **kw) -> None:
            super().__init__(*args, **kw, cascade=None)

    class GatherCache(PagedCache):
        """The former FullCache.attend: store, then gather every row's blocks padded to the longest row."""

        def begin(self, rows, n_new):
            self.gathered = list(rows), [self.length(r) for r in rows]
            return super().begin(rows, n_new)

        def attend(self, layer, q, k, v):
            self.store(layer, k, v)
            return gather_attend(self, layer, *self.gathered, q)

    model = str(smollm2_folder())
    options, (cell,) = prepare_grid(grid_options(
        {"base": model, "helper": model, "prm": HELPER_LOGLIK},
        SearchSettings(sampling=SamplingParams(), batch=4, synthetic_steps=synthetic), Path(tempfile.mkdtemp()),
        benches=["gsm8k"], methods=["full"], budgets=[64], ns=[n], seeds=[0], evictor="rkv", limit=limit))
    figures = []
    for name, cls in (("gather", GatherCache), ("paged", PagedCache), ("cascade", FullCache)):
        fresh = replace(options, out=Path(tempfile.mkdtemp()))
        group = InProcessGroup(fresh, fresh.devices, CellParts(full_cache=cls))  # the models load untimed
        try:
            started = time.perf_counter()
            summary = run_cell(fresh, cell, group, Progress(disable=True))
            wall = time.perf_counter() - started
        finally:
            group.close()
        figures.append({"variant": name, "wall_s": wall, "problems": summary.problems,
                        "base_tokens": summary.base_tokens, "problems_per_min": 60 * summary.problems / wall})
    for f in figures:
        f["speedup_vs_gather"] = figures[0]["wall_s"] / f["wall_s"]
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--layers", type=int, default=None,
                        help="layers held and timed (default: 1 on the CPU, 28 on a GPU)")
    parser.add_argument("--contexts", default="1024,2048,4096")
    parser.add_argument("--problems", default="8,64")
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--step", type=int, default=64, help="tokens each candidate holds of its current step")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--max-gib", type=float, default=2.0)
    parser.add_argument("--dtype", default=None, help="default: float32 on the CPU, bfloat16 on a GPU")
    parser.add_argument("--deterministic", action="store_true", help="batch-invariant kernels (engine/invariance.py)")
    parser.add_argument("--end-to-end", action="store_true")
    parser.add_argument("--problems-e2e", type=int, default=2)
    parser.add_argument("--synthetic-steps", default="32:16", help="LEN:COUNT of the end-to-end runs' steps")
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype) if args.dtype else torch.float32 if args.device == "cpu" else torch.bfloat16
    invariance.enable(args.deterministic)
    layers = args.layers or (1 if args.device == "cpu" else HELPER["layers"])
    table = Table(title=f"attention_bench: helper shape, {layers} of 28 layers held, N = {args.n}, "
                        f"{torch.get_num_threads()} threads, {args.device} {str(dtype).removeprefix('torch.')}"
                        + (", --deterministic" if args.deterministic else ""))
    for column in ("context", "problems", "variant", "ms/layer", "begin ms", "step ms (28 layers)", "KV GB/step",
                   "x gather"):
        table.add_column(column, justify="right")
    shapes = []
    with Progress(console=Console(stderr=True), transient=True) as progress:
        pairs = [(int(c), int(p)) for p in args.problems.split(",") for c in args.contexts.split(",")]
        task = progress.add_task("shapes", total=len(pairs))
        for context, problems in pairs:
            shape = measure_shape(args.device, dtype, context, problems, args.n, args.step, layers, args.repeats,
                                  args.max_gib)
            shapes.append(shape)
            for name in VARIANTS:
                r = shape[name]
                if "skipped" in r:
                    table.add_row(str(context), str(problems), name, "skipped", r["skipped"], "", "", "")
                    continue
                table.add_row(str(context), str(problems), name, f"{r['ms_per_layer']:.2f}", f"{r['begin_ms']:.2f}",
                              f"{r['step_ms']:.1f}", f"{r['kv_bytes_read'] / 1e9:.2f}",
                              f"{r['speedup_vs_gather']:.2f}" if "speedup_vs_gather" in r else "")
            progress.advance(task)
    Console(stderr=True).print(table)
    report = {"attention": shapes}
    if args.end_to_end:
        length, count = map(int, args.synthetic_steps.split(":"))
        report["end_to_end"] = end_to_end(args.problems_e2e, args.n, (length, count))
        e2e = Table(title=f"`full` runs, SmolLM2-135M, N = {args.n}, {args.problems_e2e} GSM8K problems, "
                          f"{count} steps of {length} tokens")
        for column in ("variant", "wall s", "problems/min", "base tokens", "x gather"):
            e2e.add_column(column, justify="right")
        for f in report["end_to_end"]:
            e2e.add_row(f["variant"], f"{f['wall_s']:.1f}", f"{f['problems_per_min']:.2f}", f"{f['base_tokens']:.0f}",
                        f"{f['speedup_vs_gather']:.2f}")
        Console(stderr=True).print(e2e)
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
