"""The engine's CPU `linear` (bf16: W @ xT for up to GEMV_ROWS rows) against F.linear (x @ WT), cache-cold.

    python benchmarks/speed/linear_bench.py [--rows 1,2,8,32,64] [--dtypes bfloat16] [--threads 1] [--repeats 3]

One decode step's weight matmuls in SmolLM2-135M's shapes (30 layers of q/k/v, o, gate/up and down projections,
then the 49152 x 576 head: 270 MB in bf16, more than any cache), each weight read once per pass, at each row count;
the two ways alternate, best of --repeats each. Prints milliseconds per pass, the weights' read rate and the ratio.
Measured on 2 shared cores, 1 thread, load average ~2 (1 December 2026), F.linear / linear time with W @ xT in
both dtypes: bfloat16 1.31 / 1.44 / 1.45 / 1.31 at 1 / 2 / 8 / 32 rows (linear reads 9.8 GB/s at 1-8 rows); float32
0.97 / 0.45 / 1.27 / 0.98, so `linear` keeps F.linear for fp32. With the result made contiguous (03c4af9), load ~1:
bfloat16 1.29 / 1.33 / 1.11 at 1 / 8 / 32 rows (the copy costs here and saves more in the ops after it).
"""

import argparse
import time

import torch
import torch.nn.functional as F

from kvrescue.engine.model import GEMV_ROWS, linear

LAYER_SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # (out, in): wqkv, wo, w13, w2
LAYERS, HEAD = 30, (49152, 576)


def pass_seconds(fn, weights: list[torch.Tensor], inputs: dict[int, torch.Tensor]) -> float:
    start = time.perf_counter()
    for w in weights:
        fn(inputs[w.shape[1]], w)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,2,8,32,64")
    parser.add_argument("--dtypes", default="bfloat16")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"GEMV_ROWS = {GEMV_ROWS}, {args.threads} thread(s), torch {torch.__version__}")
    print("  dtype    | rows | F.linear ms | linear ms | linear GB/s | F.linear / linear")
    for dtype in (getattr(torch, name) for name in args.dtypes.split(",")):
        g = torch.Generator().manual_seed(0)
        weights = [torch.randn(*shape, generator=g).to(dtype) for _ in range(LAYERS) for shape in LAYER_SHAPES]
        weights.append(torch.randn(*HEAD, generator=g).to(dtype))
        nbytes = sum(w.numel() * w.element_size() for w in weights)
        for rows in (int(r) for r in args.rows.split(",")):
            inputs = {k: torch.randn(rows, k, generator=g).to(dtype) for k in {w.shape[1] for w in weights}}
            ways = (F.linear, linear)
            best = [float("inf")] * 2
            for r in range(args.repeats + 1):  # the first pass of each is a warm-up
                for i in (0, 1) if r % 2 == 0 else (1, 0):
                    seconds = pass_seconds(ways[i], weights, inputs)
                    best[i] = min(best[i], seconds) if r else best[i]
            print(f"  {str(dtype)[6:]:8s} | {rows:4d} | {best[0] * 1e3:11.1f} | {best[1] * 1e3:9.1f} | "
                  f"{nbytes / best[1] / 1e9:11.1f} | {best[0] / best[1]:17.2f}", flush=True)


if __name__ == "__main__":
    main()
