"""Cost of the bounded evicting cache against the full cache, on a random ~100M Qwen2.

Measures, for a batch of rows decoding one token each:
- per-token decode time at several context lengths with the paged cache that `full`, `--evictor none`
  and the helper decode with (rows forked 8 to a shared prefix, as a problem's candidates are), with the
  bounded cache uncompressed (an rkv cache whose budget lies beyond the timed lengths), and with `rkv`
  at each budget B amortised over a B -> B' -> B cycle: between compressions an evicted row decodes like
  an uncompressed bounded row of the same physical length (B + 64 on average), plus one compression per
  128 tokens (`--cycle` also times real cycles end to end);
- the cost of one compression (all rows at once, all layers) and cache bytes per row;
- each evictor's per-token cost (`--evictors`): its compression, and for h2o, whose decode step also accumulates
  each entry's received attention, its own decode step at B + 64;
- the context length from which evicted decoding is cheaper than the bounded cache uncompressed and
  than the paged cache;
- the degeneration detector's CPU time per token.

Cache states are synthesised (random K/V, rows set to the wanted physical and logical lengths) instead
of prefilled, since only the lengths matter for the cost. All caches and lengths are timed round-robin
(after one warm-up decode each), minima kept.

    .venv/bin/python benchmarks/speed/evict_bench.py                     # CPU, batch 32
    .venv/bin/python benchmarks/speed/evict_bench.py --device cuda --dtype bfloat16
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import time

import torch

from kvrescue.cost import Architecture
from kvrescue.data import BUNDLED
from kvrescue.detect import gzip_ratio
from kvrescue.engine.bounded import BoundedCache
from kvrescue.engine.caches import FullCache, block_size_for
from kvrescue.engine.evictors.registry import EVICTORS
from kvrescue.evictor_catalogue import MIN_BUDGET
from kvrescue.engine.model import CausalLM, ModelArgs
from kvrescue.shapes import BUFFER

MATH500 = BUNDLED / "math500.jsonl"
QWEN_7B = dict(n_layers=28, n_kv_heads=4, head_dim=128, bytes=2)  # Qwen2.5-Math-7B, bf16


def random_qwen2(device: str, dtype: torch.dtype) -> CausalLM:
    """A ~100M-parameter Qwen2-shaped decoder (GQA 12/2 heads, q/k/v bias) with random weights."""
    args = ModelArgs(vocab_size=16384, dim=768, intermediate_size=2048, n_layers=12, n_heads=12, n_kv_heads=2,
                     head_dim=64, rope_theta=10000.0, qkv_bias=True)
    torch.manual_seed(0)
    net = CausalLM(args)
    for p in net.parameters():
        torch.nn.init.normal_(p, std=0.02)
    return net.to(device=device, dtype=dtype).eval()


def make_rows(net: CausalLM, budget: int, batch: int, physical: int, logical: int,
              policy: str = "rkv") -> tuple[BoundedCache, list[int]]:
    """A `policy` cache whose `batch` rows hold `physical` random entries at logical length `logical`."""
    cache = BoundedCache.for_model(net, budget=budget, evictor=policy, rows=batch,
                                   capacity=max(physical, budget + BUFFER) + 8)
    rows = [cache.create() for _ in range(batch)]
    cache.row_physical[rows] = cache.row_peak[rows] = physical  # benchmark only: as if appended
    cache.row_logical[rows] = logical
    cache.k.normal_()
    cache.v.normal_()
    cache.q.normal_()
    if cache.received is not None:
        cache.received.uniform_()
    return cache, rows


def uncompressed_rows(net: CausalLM, batch: int, length: int, room: int,
                      policy: str = "rkv") -> tuple[BoundedCache, list[int]]:
    """Bounded-cache rows of `length` random entries that decode `room` more tokens without a compression
    (their budget lies beyond `length + room`)."""
    return make_rows(net, max(MIN_BUDGET, length + room), batch, length, length, policy)


def make_paged_rows(net: CausalLM, batch: int, length: int, room: int, candidates: int = 8) -> tuple[FullCache, list[int]]:
    """A paged cache whose `batch` rows are forked, `candidates` at a time, from prefixes of `length` random
    entries (a problem's committed context), with room for `room` more tokens per row."""
    parents = -(-batch // candidates)
    bs = block_size_for(next(net.parameters()))
    per_child = (-(-room // bs) + 2) * bs  # its copy of the parent's last block and its own new blocks
    cache = FullCache.for_model(net, parents * -(-length // bs) * bs + batch * per_child, max_rows=parents + batch,
                                block_size=bs)
    cache.k.normal_()
    cache.v.normal_()
    rows = []
    for _ in range(parents):
        parent = cache.create()
        table = cache.block_table
        blocks = table.new_blocks(-(-length // cache.block_size))  # benchmark only: as if prefilled
        table.table[parent, :len(blocks)] = blocks
        table.n_blocks[parent], table.lengths[parent] = len(blocks), length
        rows += cache.fork(parent, min(candidates, batch - len(rows)))
    return cache, rows


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


@torch.inference_mode()
def timed_decodes(net: CausalLM, cache: BoundedCache | FullCache, rows: list[int], steps: int, device: str) -> list[float]:
    """Seconds of each of `steps` one-token decodes of every row."""
    tokens = torch.randint(0, net.args.vocab_size, (len(rows),), device=device)
    times = []
    for _ in range(steps):
        sync(device)
        t = time.perf_counter()
        net.decode(tokens, cache, rows)
        sync(device)
        times.append(time.perf_counter() - t)
    return times


def decode_cost(net, lengths: list[int], paged: list[int], batch: int, rounds: int, steps: int,
                device: str, accumulating: dict[str, list[int]] | None = None) -> dict[tuple[str, int], float]:
    """Fastest of the timed batched decode steps of uncompressed bounded rows at each physical length in
    `lengths`, of paged rows at each in `paged`, and of the bounded rows of each evictor in `accumulating`
    (H2O's decode step does more) at its lengths, keyed (cache or evictor, length). All are measured
    round-robin, in alternating order, and the minimum is kept because a shared machine only ever adds time."""
    caches = {("bounded", n): uncompressed_rows(net, batch, n, rounds * steps + 1) for n in lengths}
    caches |= {(e, n): uncompressed_rows(net, batch, n, rounds * steps + 1, e)
               for e, ns in (accumulating or {}).items() for n in ns}
    caches |= {("paged", n): make_paged_rows(net, batch, n, rounds * steps + 1) for n in paged}
    for cache, rows in caches.values():
        timed_decodes(net, cache, rows, 1, device)  # warm-up
    times: dict[tuple[str, int], list[float]] = {key: [] for key in caches}
    for r in range(rounds):
        for key in (list(caches) if r % 2 == 0 else list(caches)[::-1]):
            times[key] += timed_decodes(net, *caches[key], steps, device)
    return {key: min(t) for key, t in times.items()}


def evicted_cycle(net, budget, batch, device) -> float:
    """Seconds per token over a real B -> B' -> B cycle (128 decodes, the last compresses every row)."""
    cache, rows = make_rows(net, budget, batch, budget, 4096)
    times = timed_decodes(net, cache, rows, BUFFER, device)
    assert all(cache.physical_length(r) == budget for r in rows), "expected exactly one compression"
    return sum(times) / (BUFFER * batch)


@torch.inference_mode()
def compression_time(net, budget, batch, device, repeats: int = 3, policy: str = "rkv") -> float:
    """Seconds to compress `batch` rows of B' entries to B with `policy` (all layers, scored together)."""
    best = float("inf")
    for _ in range(repeats):
        cache, rows = make_rows(net, budget, batch, budget + BUFFER, 4096, policy)
        sync(device)
        t = time.perf_counter()
        cache.compress(rows)
        sync(device)
        best = min(best, time.perf_counter() - t)
    return best


def detector_cost() -> float:
    """Mean seconds of the decode loop's gzip test (`gzip_ratio` of the last 800 characters) per token once a text
    holds 800 characters; before that the detector does no host work per token."""
    with open(MATH500) as f:
        text = "".join(json.loads(line)["solution"] for line in f)[:60_000]
    tail, late = "", []
    for piece in re.findall(r"\S+\s*|\s+", text):
        tail = (tail + piece)[-800:]
        if len(tail) == 800:
            t = time.perf_counter()
            gzip_ratio(tail)
            late.append(time.perf_counter() - t)
    return statistics.mean(late)


def crossover(uncompressed: dict[int, float], evicted: float) -> str:
    """Where a cache's per-token time by context first exceeds `evicted` (linear interpolation)."""
    pairs = sorted(uncompressed.items())
    if pairs[0][1] > evicted:
        return f"at or below {pairs[0][0]} tokens"
    for (c0, t0), (c1, t1) in zip(pairs, pairs[1:]):
        if t0 <= evicted < t1:
            return f"about {c0 + (c1 - c0) * (evicted - t0) / (t1 - t0):.0f} tokens"
    return f"beyond {pairs[-1][0]} tokens"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--contexts", default="512,2048,4096", help="contexts reported in the table")
    ap.add_argument("--extra-contexts", default="256,1024,1536,3072", help="more uncompressed points for the crossover")
    ap.add_argument("--budgets", default="64,512")
    ap.add_argument("--evictors", default=",".join(EVICTORS),
                    help="evictors whose compression cost per token is compared with rkv's")
    ap.add_argument("--rounds", type=int, default=4, help="round-robin passes over the lengths")
    ap.add_argument("--steps", type=int, default=2, help="timed decodes per length and round")
    ap.add_argument("--cycle", action="store_true", help="also time real 128-token rkv cycles (slow on a CPU)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    net = random_qwen2(args.device, dtype)
    params = sum(p.numel() for p in net.parameters())
    print(f"random Qwen2: {params / 1e6:.0f}M parameters, {net.args.n_layers} layers, "
          f"{net.args.n_heads}/{net.args.n_kv_heads} heads x {net.args.head_dim}; batch {args.batch}; "
          f"{args.device} {args.dtype}, {torch.get_num_threads()} threads")
    shown = [int(c) for c in args.contexts.split(",")]
    contexts = sorted(set(shown) | {int(c) for c in args.extra_contexts.split(",") if c})
    budgets = [int(b) for b in args.budgets.split(",")]

    # between compressions an evicted row decodes like an uncompressed one of the same physical length;
    # over a cycle its length averages B + 64, and one compression of every row is added per 128 tokens
    t0 = time.perf_counter()
    evictors = args.evictors.split(",")
    accumulating = {e: [b + BUFFER // 2 for b in budgets] for e in evictors if EVICTORS[e].accumulates}
    step = decode_cost(net, sorted(set(contexts) | {b + BUFFER // 2 for b in budgets}), contexts, args.batch,
                       args.rounds, args.steps, args.device, accumulating)
    comp = {b: compression_time(net, b, args.batch, args.device) for b in budgets}
    bounded = {c: step[("bounded", c)] / args.batch for c in contexts}
    paged = {c: step[("paged", c)] / args.batch for c in contexts}
    evicted = {b: (step[("bounded", b + BUFFER // 2)] + comp[b] / BUFFER) / args.batch for b in budgets}
    print(f"(measured in {time.perf_counter() - t0:.0f} s)\n")

    print("per-token decode time (ms per row-token = batch step time / batch)")
    print("(paged: the full cache of `full`, `--evictor none` and the helper; bounded: the evicting cache uncompressed)")
    print(f"{'context':>8} {'paged':>8} {'bounded':>8} " + " ".join(f"{'rkv B=' + str(b):>10}" for b in budgets))
    for c in shown:
        # below B' a row has never been compressed: it is an uncompressed row of c entries
        cells = [bounded[c] if c < b + BUFFER else evicted[b] for b in budgets]
        print(f"{c:>8} {paged[c] * 1e3:8.3f} {bounded[c] * 1e3:8.3f} " + " ".join(f"{x * 1e3:10.3f}" for x in cells))
    if args.cycle:
        for b in budgets:
            print(f"  check, rkv B={b} over a real 128-token cycle: {evicted_cycle(net, b, args.batch, args.device) * 1e3:.3f} ms")

    print("\ncompression (all rows at once, all layers) and memory")
    per_entry = Architecture("bench", net.args, next(net.parameters()).element_size()).kv_bytes_per_token
    per_entry_7b = 2 * QWEN_7B["n_layers"] * QWEN_7B["n_kv_heads"] * QWEN_7B["head_dim"] * QWEN_7B["bytes"]
    for b in budgets:
        peak = b + BUFFER
        print(f"  rkv B={b}: compress {args.batch} rows of {peak} -> {b}: {comp[b] * 1e3:.0f} ms "
              f"({comp[b] / args.batch * 1e3:.1f} ms/row; {comp[b] / BUFFER / args.batch * 1e3:.3f} ms per token amortised); "
              f"peak {peak} entries = {peak * per_entry / 2**20:.2f} MiB/row here, "
              f"{peak * per_entry_7b / 2**20:.1f} MiB/row for Qwen2.5-Math-7B bf16")
    for c in shown:
        print(f"  full cache at {c}: {c * per_entry / 2**20:.2f} MiB/row here, {c * per_entry_7b / 2**20:.1f} MiB/row for 7B")

    print("\nper-token cost by evictor (decode at B + 64 plus one compression per 128 tokens; ms per row-token, "
          "the compression's time against rkv's, and for h2o its decode step's against rkv's)")
    for b in budgets:
        per = {e: comp[b] if e == "rkv" else compression_time(net, b, args.batch, args.device, policy=e)
               for e in evictors}
        decode = {e: step[(e if e in accumulating else "bounded", b + BUFFER // 2)] / args.batch for e in evictors}
        base = step[("bounded", b + BUFFER // 2)] / args.batch
        print(f"  B={b}: " + ", ".join(
            f"{e} {(decode[e] + c / BUFFER / args.batch) * 1e3:.3f} (compression x{c / per['rkv']:.2f}"
            + (f", decode x{decode[e] / base:.2f})" if e in accumulating else ")") for e, c in per.items()))

    print("\nuncompressed bounded decode by context (ms per row-token): "
          + ", ".join(f"{c}: {bounded[c] * 1e3:.2f}" for c in contexts))
    print("paged decode by context (ms per row-token): " + ", ".join(f"{c}: {paged[c] * 1e3:.2f}" for c in contexts))
    print("context from which evicted decoding is cheaper than decoding without eviction")
    for b in budgets:
        print(f"  rkv B={b} (B'={b + BUFFER}): than the bounded cache uncompressed {crossover(bounded, evicted[b])}, "
              f"than the paged cache {crossover(paged, evicted[b])}")

    print(f"\ndetector: {detector_cost() * 1e6:.1f} us/token once the text holds 800 characters (gzip each token)")


if __name__ == "__main__":
    main()
