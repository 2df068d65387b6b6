"""gpu_check's recording: deadlines that interrupt a measurement, the report written as each measurement ends,
and one line per result."""

from __future__ import annotations

import _thread
import gc
import json
import math
import signal
import threading
import time
import traceback
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

import torch

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
                skip: str | None = None, interrupt: bool = True, until: float | None = None) -> None:
        """Record `record` with what `fn` measured, or with why it was skipped (`skip`, or past `start_by`).
        `fn` is interrupted at `until` (default: the end of the budget) unless it bounds itself (`interrupt`
        False); an error is recorded, not raised."""
        now = time.perf_counter()
        if skip is None and now > start_by:
            skip = self.late()
        if skip is not None:
            self.add(section, {**record, "skipped": skip})
            return
        result: dict = {}
        gpu = torch.cuda.is_available()
        try:
            if gpu:
                torch.cuda.reset_peak_memory_stats()
            stop = (self.deadline(1.0) if until is None else until) if interrupt else None
            with interrupted_at(stop) as cut:
                result = fn()
            if cut() and not result:
                result = {"skipped": f"interrupted {stop - self.started:.0f} s into the check (its {self.budget_s:.0f} s "
                                     "budget, or the window after it)"}
            if gpu and "skipped" not in result and "peak_allocated_bytes" not in result:
                result.update(peaks(torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved(),
                                    result.get("planned_bytes")))
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


def peaks(allocated: int, reserved: int, planned: int | None) -> dict:
    """A measurement's peak allocated and reserved bytes on the GPU, and each over the memory plan's bytes where the
    measurement has a plan (its cell's `kvrescue run --plan` total): the figures that calibrate the plan and its
    headroom (issue 41: the plan should come within 10% of the peak allocated, its headroom bound the reserved)."""
    over = {"allocated_over_plan": allocated / planned, "reserved_over_plan": reserved / planned} if planned else {}
    return {"peak_allocated_bytes": allocated, "peak_reserved_bytes": reserved, **over}


def memory_note(r: dict) -> str:
    """The peaks and the plan of a result, where it has them ("" otherwise)."""
    gib = 2**30
    parts = []
    if "peak_allocated_bytes" in r:
        parts.append(f"peak {r['peak_allocated_bytes'] / gib:.2f} GiB allocated, {r['peak_reserved_bytes'] / gib:.2f} "
                     "GiB reserved")
    if r.get("planned_bytes"):
        ratios = (f" (allocated x{r['allocated_over_plan']:.2f}, reserved x{r['reserved_over_plan']:.2f} of it)"
                  if "allocated_over_plan" in r else "")
        parts.append(f"plan {r['planned_bytes'] / gib:.2f} GiB{ratios}")
    return f" [{'; '.join(parts)}]" if parts else ""


class RecordLines(Check):
    """The vllm child's records: each appended to `out` as one JSON line as it ends (no budget: its parent ends it)."""

    def __init__(self, out: Path) -> None:
        super().__init__(out, {}, math.inf)

    def add(self, section: str, record: dict) -> None:
        with self.out.open("a") as lines:
            lines.write(json.dumps(record) + "\n")


def describe(section: str, r: dict) -> str:
    """One line for one result, with its memory peaks and plan where it has them."""
    return describe_result(section, r) + ("" if "skipped" in r else memory_note(r))


def describe_result(section: str, r: dict) -> str:
    """One line for one result's own figures."""
    if section == "tp":
        return describe_tp(r)
    if section == "roofline":
        what = "copy bandwidth"
    elif section == "logits":
        what = f"{r.get('shape', '')} {r.get('dtype', '')}"
    elif section == "numerics":
        what = f"{r['path']} attention {r['shape']} {r['dtype']}"
    elif section == "memory":
        what = f"memory left by {r['method']} cells ({r['shape']})"
    elif section == "devices":
        what = f"models and caches of --devices {r['device']}"
    elif section == "invariance":
        what = f"traces at --batch {'/'.join(map(str, r['batches']))}{' --deterministic' if r['deterministic'] else ''}"
    elif section == "attention":
        what = f"full-cache attention ctx={r['context']} problems={r['problems']}"
    elif section == "vllm":
        what = (f"engine vs vLLM decode {r['shape']} batch={r['batch']}" if r["measure"] == "decode" else
                f"engine vs vLLM PRM {r['shape']} {r['problems']}x{r['steps']}x{r['candidates']} candidates")
    elif section == "e2e":
        what = f"{r['step']}" + (f" ({r['shape']})" if "shape" in r else "")
    elif section == "profile":
        what = f"{r['method']} cell profile, {r['problems_in']} problems graphs={'on' if r['cuda_graphs'] else 'off'}"
    elif section == "flex":
        budget = f" B={r['budget']}" if r.get("budget") else ""
        tokens = f" of {r['tokens']} tokens" if "tokens" in r else ""
        what = (f"FlexAttention vs SDPA rows={r['rows']} ctx={r['context']} {r['evictor']}{budget} {r['step']}{tokens}"
                if "rows" in r else "FlexAttention vs SDPA")
    elif section == "decode":
        budget = f" B={r['budget']}" if r["budget"] else ""
        what = (f"{r['engine']} rows={r['rows']} ctx={r['context']} {r['evictor']}{budget}"
                f" graphs={'on' if r['cuda_graphs'] else 'off'}")
    else:
        budget = f" B={r['budget']}" if r.get("budget") else ""
        what = f"{r['method']}{budget} graphs={'on' if r['cuda_graphs'] else 'off'}{' (warm-up)' if r.get('warm_up') else ''}"
        if "streams" in r:
            what += " a stream per model" if r["streams"] else " one stream"
        if r.get("profile"):
            length, count = r["synthetic_steps"]
            what += f" {r['profile']} profile, N={r['n']}, {count} steps of {length} tokens" + (
                f", --batch auto={r['batch_auto']}" if "batch_auto" in r else "")
    if "skipped" in r:
        return f"{what}: skipped ({r['skipped']})"
    if section == "roofline":
        return (f"{what}: {r['bytes_per_s'] / 1e9:.1f} GB/s; {r['matmul_dtype']} matrix products "
                f"{r['matmul_flop_per_s'] / 1e12:.3g} TFLOP/s")
    if section == "logits":
        return (f"{what}: ok={r['ok']} forward max|d|={r['forward']['max_abs']:.2e} top1={r['forward']['top1_agreement']:.3f}, "
                f"decode max|d|={r['prefill_then_decode']['max_abs']:.2e} top1={r['prefill_then_decode']['top1_agreement']:.3f}")
    if section == "numerics":
        c = r["comparison"]
        return f"{what}: ok={r['ok']} max|d|={c['max_abs']:.2e} top1={c['top1_agreement']:.3f}"
    if section == "memory":
        fake = " (fake CUDA)" if r["fake_cuda"] else ""
        mib = 2**20
        workspace = (f", {r['workspace_bytes'] / mib:.1f} MiB left by the first and not grown by the second: a one-time "
                     "workspace" if r["workspace_bytes"] else "")
        return (f"{what}: ok={r['ok']} {r['growth_bytes']} bytes grown by the second of {r['cells']} cells "
                f"({r['problems']} problems){workspace}{fake}")
    if section == "devices":
        return f"{what}: ok={r['ok']} on {r['models_on']}, bytes gained {r['bytes_gained']}"
    if section == "invariance":
        return f"{what}: {r['agree']} of {r['problems']} problems agree" + (f", ok={r['ok']}" if r["ok"] is not None else "")
    if section == "attention":
        return f"{what}: " + ", ".join(f"{v} skipped" if "skipped" in r[v] else
                                       f"{v} {r[v]['step_ms']:.1f} ms/step {r[v]['kv_bytes_read'] / 1e9:.2f} GB"
                                       for v in ("gather", "paged", "cascade")) + (
            f"; cost model paged {r['model']['paged_ms']:.3f} vs cascade {r['model']['cascade_ms']:.3f} ms/layer, "
            f"picks {r['model']['picks']}, measured faster: {r['model'].get('measured_faster', 'unmeasured')}")
    if section == "vllm":
        unit = "tokens_per_s" if r["measure"] == "decode" else "candidates_per_s"
        return (f"{what}: {r[f'engine_{unit}']:.1f} vs {r[f'vllm_{unit}']:.1f} {unit.replace('_per_s', '/s')} "
                f"(engine / vLLM {r['engine_over_vllm']:.2f})")
    if section == "flex":
        return (f"{what}: {r['flex_tokens_per_s']:.1f} vs {r['sdpa_tokens_per_s']:.1f} tokens/s "
                f"(flex / SDPA {r['flex_over_sdpa']:.2f}), max|d| {r['max_abs']:.2e} top1={r['top1_agreement']:.3f}, "
                f"first step {r['flex_first_step_s']:.1f} vs {r['sdpa_first_step_s']:.1f} s")
    if section == "decode":
        share = (f" ({100 * r['of_roofline']:.1f}% of roofline, {r['bound_by']}-bound)" if r["of_roofline"] is not None
                 else "")
        return f"{what}: {r['tokens_per_s']:.1f} tok/s{share}"
    if section == "e2e":
        return f"{what}: " + describe_e2e(r)
    if section == "profile":
        launches = r["launches"]
        if "failed" in launches:
            launches = {"graph_kernel_share": None}
        per = ", ".join(f"{k.removesuffix('_per_iteration').replace('_', ' ')} {v:.1f}" for k, v in launches.items()
                        if k.endswith("_per_iteration"))
        graphs = (f", {100 * launches['graph_kernel_share']:.0f}% of kernels in graphs"
                  if launches["graph_kernel_share"] is not None else "")
        counted = f"per decode iteration: {per}{graphs}" if per else f"launches not counted ({r['launches']['failed']})"
        return (f"{what}: {r['wall_s']:.2f} s, " + ", ".join(f"{p} {100 * x:.0f}%" for p, x in r["share"].items())
                + f"; host waits {r['host_waits_s']:.2f} s; {counted}")
    cut = f", {r['problems']} finished before the cut" if r["cut"] else ""
    line = f"{what}: {r['problems']} problems in {r['seconds']:.1f} s = {r['problems_per_min']:.2f}/min{cut}"
    if "time_share" in r:
        line += " (" + ", ".join(f"{p} {100 * x:.0f}%" for p, x in r["time_share"].items() if x >= 0.005) + ")"
    if "over_one_stream" in r:
        line += f"; x{r['over_one_stream']:.2f} of one stream's, same outputs: {r['same_outputs']}"
    if "kvrescue_over_bon" in r:
        line += f"; kvrescue/bon x{r['kvrescue_over_bon']:.2f}, kvrescue/full x{r['kvrescue_over_full']:.2f}"
    return line


def describe_e2e(r: dict) -> str:
    """One e2e step's figures: the checkpoints' size, or a command's exit, time and what it measured."""
    if "command" not in r:
        return f"{r['bytes'] / 2**30:.2f} GiB written in {r['seconds_taken']:.1f} s"
    line = f"exit {r['exit']} in {r['seconds']:.1f} s"
    if r["step"] == "plan":
        line += " (fits)" if r["exit"] == 0 else " (does not fit)"
    if r.get("batch") is not None:
        line += f", batch {r['batch']}"
    if "cells" in r:
        line += ", " + ", ".join(f"{m} {c['problems']} problems {c['problems_per_min'] or 0:.1f}/min"
                                 for m, c in r["cells"].items())
    if r["step"] == "rerun" and "models_loaded" in r:
        line += f", {r['models_loaded']} models loaded (ok={r.get('ok')})"
    if "page_bytes" in r:
        line += f", page {r['page_bytes'] / 2**20:.1f} MiB"
    return line + (f"; error: {r['error']}" if "error" in r else "")


def describe_tp(r: dict) -> str:
    """One line for tp_check's result (gpu_check's `tp` section)."""
    if "skipped" in r:
        return f"tp=2 vs 1: skipped ({r['skipped'][:200]})"
    rates = ", ".join(f"graphs {'on' if g == 'graphs' else 'off'}: {r['tp2'][g]:.1f} vs {r['tp1'][g]:.1f} tok/s "
                      f"(x{r['tp2'][g] / r['tp1'][g]:.2f})" for g in ("graphs", "eager")
                      if isinstance(r["tp2"].get(g), float) and isinstance(r["tp1"].get(g), float))
    return (f"tp=2 vs 1 ({r['shape']}): logits max|d|={r['logits']['max_abs']:.2e} "
            f"top1={r['logits']['top1_agreement']:.3f}; decode {rates}")


def table(report: dict) -> str:
    """Every result, one line each, grouped by section."""
    lines = ["", f"gpu_check on {report['device']} ({report['dtype']}), {report.get('elapsed_s', 0):.0f} s:"]
    for section in ("roofline", "logits", "numerics", "attention", "decode", "flex", "vllm", "memory", "devices", "invariance", "problems", "profile", "e2e",
                    "tp"):
        found = report.get(section)
        if found is None:
            continue
        lines.append(f"  {section}")
        lines += [f"    {describe(section, r)}" for r in (found if isinstance(found, list) else [found])]
    return "\n".join(lines)
