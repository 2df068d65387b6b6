"""What Ray costs a run: starting a private local instance, and the per-problem overhead of decoding on an
actor (problems pulled and traces returned through actor calls) against decoding in this process.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/speed/ray_bench.py [--problems 16] [--rounds 2]

Tiny random checkpoints (the tests' shapes), `bon` with N = 2 and a few short steps. Each round times,
interleaved: Ray's start (init + one actor ready, models not loaded) and shutdown; one actor round trip
carrying what a problem costs the protocol (a Problem out, its Trace back: one call each way, `--calls`
times); then one cell decoded in-process and on one actor (models loaded before the clock starts in both),
with the same torch thread count. Prints a table and JSON, the best round of each (a shared machine only
adds time): the end-to-end overhead (actor - in-process) / problems is as noisy as the decode itself; the
round trip is the transport's own cost per problem.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from kvrescue import workers
from kvrescue.data import Problem, ProblemSet
from kvrescue.engine.sampling import SamplingParams
from kvrescue.cell_plan import Cell
from kvrescue.grid import grid_options
from kvrescue.in_process import InProcessGroup
from kvrescue_testkit.random_checkpoints import write_random_checkpoint
from kvrescue.search import SearchSettings

TINY = dict(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128, init_std=0.1)


class Ping:
    """An empty actor: what starting one costs without models."""

    def ping(self) -> int:
        return os.getpid()

    def relay(self, messages: list) -> list:
        return messages


def ray_costs_s(problem: Problem, trace, calls: int) -> tuple[float, float, float]:
    """Seconds to start a private instance with one ready actor, for one problem's round trip (a Problem
    sent, its Trace returned), and to shut the instance down."""
    import ray

    start = time.perf_counter()
    ray.init(address="local", num_cpus=1, object_store_memory=workers.OBJECT_STORE, **workers.RAY_QUIET)
    actor = ray.remote(Ping).options(num_cpus=1).remote()
    ray.get(actor.ping.remote())
    up = time.perf_counter() - start
    start = time.perf_counter()
    for _ in range(calls):
        ray.get(actor.relay.remote([("problem", problem)]))
        ray.get(actor.relay.remote([("trace", trace, 0)]))
    trip = (time.perf_counter() - start) / calls
    start = time.perf_counter()
    ray.shutdown()
    return up, trip, time.perf_counter() - start


def decode_s(executor, cell: Cell, problems: list[Problem]) -> tuple[float, list]:
    traces = []
    start = time.perf_counter()
    executor.decode_cell(cell, problems, lambda trace, tokens: traces.append(trace))
    seconds = time.perf_counter() - start
    assert sorted(t.idx for t in traces) == [p.idx for p in problems]
    return seconds, traces


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--problems", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--calls", type=int, default=200)
    args = parser.parse_args()
    threads = os.cpu_count() or 1  # what one CPU actor gets (workers.RayWorkers): the same here
    torch.set_num_threads(threads)
    folder = Path(tempfile.mkdtemp())
    base = write_random_checkpoint(folder / "base", "qwen2", seed=1, **TINY)
    prm = write_random_checkpoint(folder / "prm", "prm", seed=3, **TINY)
    settings = SearchSettings(sampling=SamplingParams(temperature=1.0, top_p=1.0, top_k=0), max_step_tokens=12,
                              max_steps=4, context_cap=320, batch=4)
    options = grid_options({"base": str(base), "prm": str(prm)}, settings, folder / "runs", benches=["bench"],
                           methods=["bon"], budgets=[16], ns=[2], seeds=[0], evictor="rkv", devices=("cpu",))
    problems = [Problem(i, f"What is {i} + {i + 1}? Let x be the answer.", str(2 * i + 1), {})
                for i in range(args.problems)]
    cell = Cell(ProblemSet("bench", "generic", "bench.jsonl", []), "bon", 16, 2, 0)
    here = InProcessGroup(options, ("cpu",))
    starts, trips, stops, local, remote = [], [], [], [], []
    seconds, traces = decode_s(here, cell, problems)  # a warm-up, and traces of the real size
    for _ in range(args.rounds):
        up, trip, down = ray_costs_s(problems[0], traces[0], args.calls)
        starts.append(up)
        trips.append(trip)
        stops.append(down)
        local.append(decode_s(here, cell, problems)[0])
        with workers.RayWorkers(options, print) as actor:
            actor.start()
            remote.append(decode_s(actor, cell, problems)[0])
    figures = {"ray_start_s": min(starts), "ray_shutdown_s": min(stops), "round_trip_ms": 1e3 * min(trips),
               "in_process_s": min(local),
               "actor_s": min(remote), "problems": args.problems, "threads": threads,
               "overhead_ms_per_problem": 1e3 * (min(remote) - min(local)) / args.problems,
               "actor_over_in_process": min(remote) / min(local)}
    table = Table(title=f"ray_bench: {args.problems} tiny bon problems, best of {args.rounds} interleaved rounds, "
                        f"{threads} threads, load {os.getloadavg()[0]:.1f}")
    for column in ("ray start s", "ray shutdown s", "round trip ms/problem", "in-process s", "actor s",
                   "actor / in-process", "overhead ms/problem"):
        table.add_column(column, justify="right")
    table.add_row(f"{figures['ray_start_s']:.2f}", f"{figures['ray_shutdown_s']:.2f}", f"{figures['round_trip_ms']:.2f}",
                  f"{figures['in_process_s']:.2f}", f"{figures['actor_s']:.2f}",
                  f"{figures['actor_over_in_process']:.3f}", f"{figures['overhead_ms_per_problem']:.1f}")
    Console(stderr=True).print(table)
    print(json.dumps(figures, indent=1))


if __name__ == "__main__":
    main()
