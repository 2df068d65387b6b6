"""One-call GPU check: engine logits vs transformers, decode tokens/s, vs vLLM, problems/min, a cell's profile, the
commands a user types, and the roofline.

    python benchmarks/gpu_check/gpu_check.py --out gpu_check.json          # a lent GPU (cuda: the current one): ~8 minutes
    python benchmarks/gpu_check/gpu_check.py --tiny --out /tmp/check.json  # the CPU, tiny shapes

Every model has random weights in the shape of a real one (the config values below; nothing is
downloaded). Sections, in this order:
- `roofline`: the measured device-to-device copy bandwidth and the rate of a square matrix product in the run's
  dtype (bf16 on a GPU).
- `logits`: this engine vs transformers on a random Qwen2.5-0.5B-shaped Qwen2, in the run's dtype: a
  plain forward, and a prefill plus one-token decode steps through the static (CUDA-graph) path of the
  bounded cache (rkv with a budget beyond the sequence, so every token stays cached); max/mean |difference|, cosine, top-1 agreement and `ok` under the dtype's tolerance.
- `attention`: the full cache's attention at the helper's shape (Qwen2.5-Math-1.5B, 28 layers), gather vs
  paged vs cascade, decode step time and KV bytes read, context 1k/2k/4k, 8 and 64 problems x N = 8
  (`benchmarks/speed/attention_bench.py`), each shape with the cascade cost model's times (`shapes.CascadeCost`,
  CUDA's constants) and choice next to the measured faster of paged and cascade: where they disagree, the model's
  constants need recalibrating (docs/benchmarks.md, "Cascade's cost model").
- `decode`: tokens/s of one-token decode steps with Qwen2.5-Math-7B's shape, rows 64/256/512, rkv at
  budgets 64 and 512 and `none` (the full cache), each with and without CUDA graphs (engine/graphs.py's static
  step), context 1k and 4k, and transformers `generate` at the same rows and context. Both sides do the same work per token: a forward, fp32
  logits, and top-k/top-p sampling at the paper's settings (this engine also pays its entropy). Each
  with its roofline, the longer of a step's reads (weights and each row's cached K/V, over the copy bandwidth) and
  its FLOPs (over the matrix-product rate), which of the two binds, and the share of it reached. Shapes that don't fit in memory are listed with the reason.
- `flex`: decode tokens/s with attention through FlexAttention (the pools read in place) vs SDPA (gathered), back to
  back, rows 64/256/512: rkv at B = 64 and 512 and the full cache at 1k, eagerly and through the static step (CUDA
  graphs); and the full cache's forwards of 32 tokens a row over 1k and 2k cached at 16 and 128 rows (the PRM's
  scoring shape); with the logits of the first step or forward of each compared (`gpu_check_flex`).
- `vllm`: this engine vs vLLM as benchmarks/speed/vs_vllm.py compares them (its functions), in the 7B shapes with
  random weights (vLLM's own, load_format "dummy"), same dtype: decode tokens/s at batch 1/8/32 (the Runner
  vs `generate` with `ignore_eos`, 64 new tokens) and PRM candidates scored per second (PRMScorer vs
  VLLMPRMScorer, 4 problems x 4 steps x 8 candidates), each with engine / vLLM. vLLM gets VLLM_MEMORY of
  the device; it runs in a child process (`--vllm-child`). Where vLLM is not importable every record
  says so (skipped, with the install hint). With `--tiny` vLLM's engines start eager (no compiled graphs).
- `numerics`: the caches' attention paths against a reference computed another way (`gpu_check_numerics`): the full
  cache's paged attention and its cascade against a plain causal forward of the same sequences (flash-attn's paged
  kernel where it is installed), and the bounded cache's static step (CUDA graphs on a GPU) through a compression
  against the dynamic eager step from the same state; `ok` under the dtype's tolerance, as for `logits`.
- `memory`: two kvrescue cells, one after the other, with the cyclic garbage collector off: the second must leave
  no more bytes allocated than the first (growth is a leak); what the first left is reported as a one-time workspace
  (on a CPU on fake CUDA, `kvrescue_testkit.fake_cuda`).
- `devices` (two or more GPUs; else a skip record): `kvrescue run`'s in-process executor given the last visible GPU
  loads small random checkpoints and decodes a kvrescue cell there: every parameter on that GPU, no other GPU gains
  allocated bytes.
- `invariance`: whether `--deterministic` makes 8 problems' traces the same at `--batch 1` and `--batch 8` on this
  device (and how many agree without it), each run a fresh `kvrescue run` process (`gpu_check_invariance`).
- `problems`: problems/min of bon and kvrescue with and without CUDA graphs, and full (which never
  uses them), through `kvrescue run`'s decode code, N = 8, B = 64, random 7B/1.5B/PRM-7B-shaped
  models, synthetic steps, after one warm-up problem; then the paper's MATH500 profile (21 steps of 32 tokens) at
  `--batch auto`, bon, full and kvrescue, with kvrescue/bon, kvrescue/full and each model's share of the time (in a
  window of its own after the budget, PROFILE_WINDOW of it, shared with the profile).
- `profile`: one kvrescue cell's time by phase and its launches per decode iteration (`gpu_check_profile`).
- `e2e` (in a window of its own, E2E_SHARE of the budget): random checkpoints on disk, then `kvrescue run --plan`, `run` of
  bon, kvrescue and full at a fixed batch and at `--batch auto`, the rerun that loads nothing, `report` and `view`,
  each in its own process as a user types it (`gpu_check_e2e`).
- `tp` (two or more GPUs only): benchmarks/gpu_check/tp_check.py, tensor parallelism over GPUs 0 and 1.

On a GPU every measurement records its peak allocated and reserved bytes, and those of `kvrescue run`'s cells beside
their memory plan (`planned_bytes`, `allocated_over_plan`, `reserved_over_plan`): the figures that calibrate the plan
and its headroom.

Time: every measurement is bounded by `--budget-s` (seconds from the start), but those with windows of their own
(PROFILE_WINDOW and E2E_SHARE of it, each from its start): the default takes 240 + 90 + 150 s. Measurements not started in
time are recorded as skipped (decode ones past DECODE_SHARE of the budget, vllm ones past VLLM_SHARE, the
others past all of it); a measurement still running at the end of the budget (or, for a problems
measurement, at the end of its equal share of what is left) is interrupted: a problems measurement keeps
the problems that finished and records how many were cut. vLLM's start-up does not stop for an interrupt,
so the vllm section's child process group is ended (SIGTERM, then SIGKILL 10 s later) at VLLM_SHARE of the
budget, keeping the records it finished. Each measurement prints one line as it ends and rewrites the
JSON, so a killed check keeps what it measured; a table of every result ends the run.

Each section is a module beside this entry point: gpu_check_setup (plans, shapes, random models), gpu_check_record
(deadlines, the report, one line per result), gpu_check_logits, gpu_check_numerics, gpu_check_decode (roofline,
attention, decode), gpu_check_flex, gpu_check_vllm, gpu_check_memory, gpu_check_devices, gpu_check_invariance, gpu_check_problems,
gpu_check_profile and gpu_check_e2e (with gpu_check_cli, the CLI it runs).
"""

from __future__ import annotations

import argparse
import platform
import time
from pathlib import Path

import torch

from benchmarks.gpu_check.gpu_check_decode import attention_section, decode_section, device_limits
from benchmarks.gpu_check.gpu_check_devices import devices_section
from benchmarks.gpu_check.gpu_check_e2e import e2e_section
from benchmarks.gpu_check.gpu_check_flex import flex_section
from benchmarks.gpu_check.gpu_check_invariance import invariance_section
from benchmarks.gpu_check.gpu_check_logits import check_logits
from benchmarks.gpu_check.gpu_check_memory import memory_section
from benchmarks.gpu_check.gpu_check_numerics import numerics_section
from benchmarks.gpu_check.gpu_check_problems import problems_section
from benchmarks.gpu_check.gpu_check_record import Check, interrupted_at, table  # noqa: F401 (Check, interrupted_at: tests/benchmarks/test_gpu_check.py)
from benchmarks.gpu_check.gpu_check_setup import E2E_SHARE, FULL, SMALL
from benchmarks.gpu_check.gpu_check_vllm import vllm_child, vllm_section
from kvrescue.devices import is_gpu
from kvrescue.engine.graphs import flash_attn_with_kvcache
from kvrescue.group_models import indexed_gpu, use_device
from kvrescue.outputs import installed_version


def chosen_device(requested: str | None, tiny: bool) -> str:
    """The device checked: `--device` (default: cuda when available, else cpu), `cuda` read as the current GPU
    (`cuda:N`), made this process's current device as `kvrescue run` makes it (its allocator settings too), so that
    graphs, streams and every default-device call are on GPU N, not 0."""
    device = "cpu" if tiny else requested or ("cuda" if torch.cuda.is_available() else "cpu")
    if not is_gpu(device):
        return device
    use_device(device)  # first: the allocator is configured before CUDA starts
    return indexed_gpu(device)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiny", action="store_true", help="tiny shapes on the CPU, end to end in well under a minute")
    parser.add_argument("--device", default=None, help="default: cuda when available, else cpu (always cpu with --tiny)")
    parser.add_argument("--out", type=Path, default=Path("gpu_check.json"))
    parser.add_argument("--skip", default="",
                        help="comma list of sections to leave out: logits,numerics,attention,decode,flex,vllm,memory,"
                             "devices,invariance,problems,e2e,tp")
    parser.add_argument("--budget-s", type=float, default=240.0,
                        help="seconds from the start within which every measurement starts and ends, then windows "
                             "of their own for the profiles and e2e (see the top)")
    parser.add_argument("--vllm-child", type=Path, default=None, metavar="OUT",
                        help="only measure the vllm section, appending its records to OUT as JSON lines (the section "
                             "runs so in a child process, which ends at its share of the budget)")
    args = parser.parse_args()
    device = chosen_device(args.device, args.tiny)
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
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
    check.measure("roofline", {}, end, lambda: device_limits(device, dtype, args.tiny))
    if "logits" not in skip:
        check.measure("logits", {}, end, lambda: check_logits(device, dtype, args.tiny, plan))
    if "attention" not in skip:
        attention_section(check, device, dtype, args.tiny)
    if "decode" not in skip:
        decode_section(check, device, dtype, args.tiny, plan)
    if "flex" not in skip:
        flex_section(check, device, dtype, args.tiny, plan)
    if "vllm" not in skip:
        vllm_section(check, device, dtype, args.tiny, plan)
    if "numerics" not in skip:
        numerics_section(check, device, dtype, args.tiny)
    if "memory" not in skip:
        memory_section(check, device, dtype, args.tiny, plan)
    if "devices" not in skip:
        devices_section(check, device, plan)
    if "invariance" not in skip:
        invariance_section(check, device, dtype, args.tiny)
    if "problems" not in skip:
        problems_section(check, device, dtype, args.tiny, plan)
    if "e2e" not in skip:
        e2e_section(check, device, dtype, args.tiny, time.perf_counter() + E2E_SHARE * args.budget_s)
    if "tp" not in skip and device.startswith("cuda") and torch.cuda.device_count() >= 2:
        from benchmarks.gpu_check.tp_check import tp_section
        check.measure("tp", {}, end, lambda: tp_section(tiny=False, timeout_s=max(end - time.perf_counter(), 1.0)),
                      interrupt=False)
    print(table(report), flush=True)
    print(f"wrote {args.out} in {time.perf_counter() - check.started:.1f} s", flush=True)


if __name__ == "__main__":
    main()
