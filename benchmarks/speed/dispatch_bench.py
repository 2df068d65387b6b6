"""Operations the host dispatches per decoded candidate token on fake CUDA, per method and role: the CPU proxy of the
GPU's launch overhead (issue 40), measured without a GPU.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/speed/dispatch_bench.py [--baseline a82926b] [--methods bon,kvrescue,full]
        [--by-op K] [--steps S]

`kvrescue_testkit.dry_run` decodes each method's cell on one fake CUDA device (`fake_cuda`) at the paper's shapes
(Qwen2.5-Math-7B base, 1.5B helper, PRM-7B in bf16), CUDA graphs on, 2 problems, N = 8, B = 64, synthetic steps of 8
tokens x 2 (`--steps`: S steps; more amortise the captures of the first), prefill, PRM scoring and commits included.
A `TorchDispatchMode` around it counts every aten op the host dispatches: a CUDA graph's capture dispatches its
step's ops once (counted in `ops/token`, and shown apart: `in captures`; `outside graphs` leaves them out, as they
are recorded into the graph rather than launched), its replays none. Each op goes to the role whose runner (or static
step, or scorer) is innermost on the Python stack when it is dispatched (base, helper, prm; `loop` for the
controller's own). Figures are ops / candidate tokens decoded (base and helper together). `PRM forwards` and `PRM
positions` count the PRM's forwards and the token positions they compute, padding to a static bucket included: what
its forwards cost a GPU. The op count is deterministic: `--baseline REF` runs the same cells with a git ref's code in
a fresh process beside this tree's. The host time per token on a near-free model is `host_bench.py`'s.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from collections import Counter
from pathlib import Path

from benchmarks.speed.host_bench import ROOT, export_tree, measured_in

SETTINGS = dict(batch=2, synthetic=(8, 2), n=8, budget=64)


def measure(methods: list[str], steps: int = SETTINGS["synthetic"][1]) -> dict:
    """Each method's dispatched ops (in all, in captures, by role) and candidate tokens, from a dry run of `steps`
    steps."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    import kvrescue
    try:  # the dry run of the tree measured: in the product before 6 December 2026
        import kvrescue.dry_run as dry
        import kvrescue.fake_cuda as fake_cuda
    except ImportError:
        import kvrescue_testkit.dry_run as dry
        import kvrescue_testkit.fake_cuda as fake_cuda

    owners: dict[int, str] = {}  # id of a runner, static step or scorer -> its role
    engines: list = []
    cudas: list = []

    class Count(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.by_role: Counter = Counter()
            self.by_place: Counter = Counter()  # (role, the owner's method, aten op)
            self.captured = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if cudas and cudas[-1].capturing:
                self.captured += 1
            role, method = _owner(sys._getframe(1), owners)
            self.by_role[role] += 1
            self.by_place[f"{role}.{method} {func.overloadpacket.__name__}"] += 1
            return func(*args, **(kwargs or {}))

    build_cell, enter = dry.build_cell, fake_cuda.FakeCuda.__enter__
    prm_work: Counter = Counter()  # the PRM's forwards, and the token positions they compute (padding included)

    def recording_build(*args, **kwargs):
        engine = build_cell(*args, **kwargs)
        engines.append(engine)
        owners[id(engine.scorer)] = "prm"
        _count_prm_forwards(engine.scorer, prm_work)
        for role, runner in engine.runners.items():
            owners[id(runner)] = role
            if getattr(runner, "static", None) is not None:
                owners[id(runner.static)] = role
        return engine

    def recording_enter(cuda):
        cudas.append(cuda)
        return enter(cuda)

    dry.build_cell, fake_cuda.FakeCuda.__enter__ = recording_build, recording_enter
    cells, cell = [], dry._cell

    def counted_cell(*args, **kwargs):
        before, places, captured = Counter(count.by_role), Counter(count.by_place), count.captured
        prm_work.clear()
        out = cell(*args, **kwargs)
        tokens = {role: runner.decoded for role, runner in engines[-1].runners.items()}
        cells.append({"method": out.method, "tokens": tokens, "ops": dict(count.by_role - before),
                      "places": dict(count.by_place - places), "prm_work": dict(prm_work),
                      "captured": count.captured - captured, "graph_replays": out.graph_replays})
        return out

    dry._cell = counted_cell
    with Count() as count:
        dry.dry_run(tuple(methods), **settings(steps))
    return {"code": str(Path(kvrescue.__file__).parents[1]), "torch": torch.__version__, "cells": cells}


def _count_prm_forwards(scorer, work: Counter) -> None:
    """Count the PRM scorer's forwards into `work`: static ones (the bucket each takes, `StaticDecode._run`) and
    eager ones (`prefill`), with the token positions each computes, padding included (what a GPU computes)."""
    static, net = getattr(scorer, "static", None), getattr(getattr(scorer, "prm", None), "net", None)
    if static is not None:
        run = static._run

        def counted_run(rows, key, host, tokens=None):
            used, _ = static._captured_cover(key, host)
            work["forwards"] += 1
            work["positions"] += used[0] * static.side.tokens(used)
            return run(rows, key, host, tokens)

        static._run = counted_run
    if net is not None:
        prefill = net.prefill

        def counted_prefill(tokens, *args, **kwargs):
            work["forwards"] += 1
            work["positions"] += tokens.numel()
            return prefill(tokens, *args, **kwargs)

        net.prefill = counted_prefill


def _owner(frame, owners: dict[int, str]) -> tuple[str, str]:
    """The role of the innermost runner, static step or scorer on the stack from `frame` (`loop`: none), and where
    in it: its outermost and innermost methods on the stack (`commit/append`; one name where they are the same)."""
    role, methods = None, []
    while frame is not None:
        code = frame.f_code
        if code.co_argcount and code.co_varnames[0] == "self":
            owner = owners.get(id(frame.f_locals.get("self")))
            if owner is not None and role in (None, owner):
                role = owner
                methods.append(code.co_name)
            elif role is not None:
                break
        frame = frame.f_back
    if role is None:
        return "loop", ""
    return role, methods[-1] if methods[0] == methods[-1] else f"{methods[-1]}/{methods[0]}"


def per_token(cell: dict) -> tuple[float, float]:
    """A cell's ops per candidate token: all it dispatched, and those outside its graphs' captures."""
    tokens, total = sum(cell["tokens"].values()), sum(cell["ops"].values())
    return total / tokens, (total - cell["captured"]) / tokens


def settings(steps: int) -> dict:
    """The dry run's settings with `steps` synthetic steps."""
    return {**SETTINGS, "synthetic": (SETTINGS["synthetic"][0], steps)}


def run_worker(code: Path, methods: list[str], steps: int) -> dict:
    """This file's `measure` (not the one `code` may hold) in a fresh process importing kvrescue from `code`."""
    return measured_in(code, "runpy", f"run_path({str(Path(__file__).resolve())!r})['measure']({methods!r}, {steps})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", help="a git ref to measure beside this tree, e.g. a82926b")
    parser.add_argument("--methods", default="bon,kvrescue,full")
    parser.add_argument("--by-op", type=int, default=0, metavar="K",
                        help="also print this tree's K largest (role.method, aten op) counts per method, per token")
    parser.add_argument("--steps", type=int, default=SETTINGS["synthetic"][1], help="synthetic steps a problem")
    args = parser.parse_args()
    methods = args.methods.split(",")
    with tempfile.TemporaryDirectory() as tmp:
        trees = {"this tree": ROOT}
        if args.baseline:
            trees[args.baseline] = export_tree(args.baseline, Path(tmp) / "baseline")
        results = {name: run_worker(code, methods, args.steps) for name, code in trees.items()}
    roles = ("base", "helper", "prm", "loop")
    print("ops dispatched per decoded candidate token, fake CUDA, paper shapes, CUDA graphs on,", settings(args.steps))
    print(f"| code | method | ops/token | {' | '.join(roles)} | in captures | outside graphs | replays | tokens | "
          "PRM forwards | PRM positions | vs this tree | outside graphs vs this tree |")
    print("|---|---|---|" + "---|" * len(roles) + "---|---|---|---|---|---|---|---|")
    mine = {c["method"]: per_token(c) for c in results["this tree"]["cells"]}
    for name, result in results.items():
        for c in result["cells"]:
            tokens = sum(c["tokens"].values())
            total, outside = per_token(c)
            per_role = " | ".join(f"{c['ops'].get(role, 0) / tokens:.1f}" for role in roles)
            work = c["prm_work"]
            print(f"| {name} | {c['method']} | {total:.1f} | {per_role} | {c['captured'] / tokens:.1f} | "
                  f"{outside:.1f} | {c['graph_replays']} | {tokens} | {work.get('forwards', 0)} | "
                  f"{work.get('positions', 0)} | {total / mine[c['method']][0]:.2f}x | "
                  f"{outside / mine[c['method']][1]:.2f}x |")
    for c in results["this tree"]["cells"] if args.by_op else ():
        tokens = sum(c["tokens"].values())
        places: Counter = Counter()
        for place, n in c["places"].items():
            places[place.split(" ")[0]] += n
        print(f"\n{c['method']}: ops per token by role.method: " +
              ", ".join(f"{place} {n / tokens:.1f}" for place, n in places.most_common()))
        print(f"{c['method']}: the {args.by_op} largest (role.method op) counts per token")
        for place, n in Counter(c["places"]).most_common(args.by_op):
            print(f"  {n / tokens:6.2f}  {place}")


if __name__ == "__main__":
    main()
