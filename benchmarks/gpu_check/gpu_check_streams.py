"""gpu_check's streams comparison (part of the `problems` section): one kvrescue cell with a CUDA stream per model
(the default, `engine/streams.py`) and with one stream (`KVRESCUE_STREAMS=0`), back to back on the same problems:
problems/min of each, their ratio, and whether the outputs are the same, so that the default follows a measurement."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from benchmarks.gpu_check.gpu_check_record import Check
from kvrescue.data import ProblemSet
from kvrescue.engine.loader import LoadedModel
from kvrescue.grid import GridOptions

STREAM_RUNS = (False, True)  # one stream first, then a stream per model


@contextmanager
def streams_env(on: bool) -> Iterator[None]:
    """`KVRESCUE_STREAMS` set for the block (read when a cell's runners are built), then as it was."""
    previous = os.environ.get("KVRESCUE_STREAMS")
    os.environ["KVRESCUE_STREAMS"] = "1" if on else "0"
    try:
        yield
    finally:
        if previous is None:
            del os.environ["KVRESCUE_STREAMS"]
        else:
            os.environ["KVRESCUE_STREAMS"] = previous


def streams_comparison(check: Check, options: GridOptions, models: Callable[[], dict[str, LoadedModel]],
                       problems: ProblemSet, plan: dict, end: float, rate: Callable[..., dict]) -> None:
    """kvrescue's problems/min with one stream and with a stream per model (`rate`: `problems_rate`), each in an
    equal share of the time to `end`; the second record compares the two."""
    record = {"method": "kvrescue", "cuda_graphs": options.cuda_graphs, "n": plan["n"], "budget": plan["budget"],
              "synthetic_steps": list(plan["synthetic"])}
    if not options.devices[0].startswith("cuda"):
        for on in STREAM_RUNS:
            check.add("problems", {**record, "streams": on, "skipped": "streams need a GPU"})
        return
    results: dict[bool, dict] = {}
    for i, on in enumerate(STREAM_RUNS):
        share = time.perf_counter() + (end - time.perf_counter()) / (len(STREAM_RUNS) - i)

        def measured() -> dict:
            with streams_env(on):
                result = results[on] = rate(options, models(), problems, "kvrescue", plan, share)
            one = results.get(False, {})
            if on and "problems_per_min" in result and "problems_per_min" in one:
                complete = not (result["cut"] or one["cut"])
                result.update(over_one_stream=result["problems_per_min"] / one["problems_per_min"],
                              same_outputs=result["outputs_sha256"] == one["outputs_sha256"] if complete else None)
            return result

        check.measure("problems", {**record, "streams": on}, end, measured, interrupt=False)
