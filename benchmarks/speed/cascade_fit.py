"""Fit the full cache's cascade cost model (`shapes.CascadeCost`) to measured decode steps on this device.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/speed/cascade_fit.py            # CPU, float32, the helper's shape

Times one layer of paged and of cascaded attention (`attention_bench.measure_shape`: N = 8 candidates a problem,
one new token a row) at each of `--problems` x `--contexts`, then fits, by least squares relative to the times,
the saving paged ms - cascade ms = the shared bytes paged re-reads / bandwidth - pass - query x rows (what decides;
the cost both pay alike cancels). Prints each shape's measured and predicted saving, the faster measured and the
choice of the fitted model and of the model in shapes.py, and the fitted constants (JSON on stdout).
"""

from __future__ import annotations

import argparse
import json

import numpy as np
import torch
from rich.console import Console
from rich.table import Table

from benchmarks.speed.attention_bench import measure_shape
from kvrescue.shapes import CascadeCost, cascade_cost_on


def fit(shapes: list[dict]) -> CascadeCost:
    """The cost model whose predicted saving, paged ms - cascade ms = re-read bytes / bandwidth - pass - query x rows,
    fits the measured ones by least squares relative to each shape's time (a loaded machine's noise grows with it)."""
    saved = np.array([s["paged"]["ms_per_layer"] - s["cascade"]["ms_per_layer"] for s in shapes])
    scale = np.array([s["paged"]["ms_per_layer"] + s["cascade"]["ms_per_layer"] for s in shapes])
    terms = np.array([[s["model"]["re_read_bytes"], -1.0, -float(s["rows"])] for s in shapes])
    (per_byte, pass_ms, query_ms), *_ = np.linalg.lstsq(terms / scale[:, None], saved / scale, rcond=None)
    return CascadeCost(bytes_per_s=1e3 / per_byte, pass_s=max(pass_ms, 0.0) / 1e3, query_s=max(query_ms, 0.0) / 1e3)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--contexts", default="64,128,256,512,1024,2048")
    parser.add_argument("--problems", default="1,8")
    parser.add_argument("--step", type=int, default=64, help="tokens each candidate holds of its current step")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    shapes = [measure_shape(args.device, dtype, int(c), int(p), step=args.step, repeats=args.repeats)
              for p in args.problems.split(",") for c in args.contexts.split(",")]
    shapes = [s for s in shapes if "skipped" not in s["paged"]]
    fitted = fit(shapes)
    now = cascade_cost_on(args.device.startswith("cuda"))
    table = Table(title=f"cascade_fit: helper shape, N = 8, {args.device} {args.dtype}, "
                        f"{torch.get_num_threads()} threads, ms per layer")
    for column in ("problems", "context", "paged", "cascade", "faster", "saved", "fitted saved", "fitted picks",
                   "shapes.py saved", "shapes.py picks"):
        table.add_column(column, justify="right")
    for s in shapes:
        re_read, rows = s["model"]["re_read_bytes"], s["rows"]
        paged, cascade = s["paged"]["ms_per_layer"], s["cascade"]["ms_per_layer"]
        table.add_row(str(s["problems"]), str(s["context"]), f"{paged:.3f}", f"{cascade:.3f}",
                      s["model"]["measured_faster"], f"{paged - cascade:.3f}",
                      *(cell for cost in (fitted, now) for cell in (
                          f"{1e3 * (re_read / cost.bytes_per_s - cost.extra_s(rows)):.3f}",
                          "cascade" if cost.pays(re_read, rows) else "paged")))
    Console(stderr=True).print(table)
    print(json.dumps({"fitted": vars(fitted), "shapes_py": vars(now), "shapes": shapes}, indent=1))


if __name__ == "__main__":
    main()
