"""Tensor-parallel check: logits of --tp 2 against one device, and decode tokens/s of both.

    python benchmarks/gpu_check/tp_check.py --out tp_check.json        # two GPUs: NCCL, bf16, Qwen2.5-Math-7B's layer shape
    python benchmarks/gpu_check/tp_check.py --tiny --out /tmp/tp.json  # the CPU: two gloo ranks, a tiny shape (the test)

A random Qwen2 checkpoint in Qwen2.5-Math-7B's shape (28/4 heads, hidden 3584, MLP 18944, vocab 152064;
LAYERS of its 28 layers, so the check stays within minutes) is written to disk; two rank processes load
it with tp=2 (each reads only its shard), and rank 0 also loads it whole on its own device. Reported:
max |difference| and top-1 agreement of the logits of a plain forward (two devices vs one), and tokens/s
of one-token decode steps over an rkv cache at B = 64 (gpu_check's `decode_rate`: rows filled with random
K/V, sampling at the paper's settings), with and without CUDA graphs, rounds alternating one device and
two so both see the same machine. gpu_check.py runs it as its `tp` section when two GPUs are visible.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.gpu_check.gpu_check_record import describe_tp

LAYERS = 4
SHAPE_7B = dict(hidden_size=3584, num_layers=LAYERS, num_heads=28, num_kv_heads=4, intermediate_size=18944,
                vocab_size=152064, init_std=0.02)
SHAPE_TINY = dict(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128, vocab_size=515,
                  init_std=0.1)
FULL = dict(rows=64, context=1024, budget=64, steps=16, rounds=2, prompt=256)
TINY = dict(rows=4, context=64, budget=16, steps=3, rounds=1, prompt=24)


def tp_section(tiny: bool, timeout_s: float = 300.0) -> dict:
    """Run the check over two ranks (GPUs 0 and 1, or two CPU processes with `tiny`); its JSON result."""
    with tempfile.TemporaryDirectory() as tmp:
        from kvrescue_testkit.random_checkpoints import write_random_checkpoint

        dtype = torch.float32 if tiny else torch.bfloat16
        write_random_checkpoint(Path(tmp) / "model", "qwen2", dtype=dtype, device="cpu" if tiny else "cuda:0",
                                **(SHAPE_TINY if tiny else SHAPE_7B))
        procs = [subprocess.Popen([sys.executable, __file__, "--rank", str(rank), "--dir", tmp, *(["--tiny"] if tiny else [])],
                                  stderr=subprocess.PIPE) for rank in range(2)]
        errors = []
        for p in procs:
            try:
                _, err = p.communicate(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                p.kill()
                _, err = p.communicate()
            if p.returncode != 0:
                errors.append(err.decode()[-500:])
        if errors:
            return {"skipped": "failed: " + " | ".join(errors)}
        return json.loads((Path(tmp) / "result.json").read_text())


def _rank(rank: int, folder: Path, tiny: bool) -> None:
    """One rank: the sharded model (and on rank 0 the whole one), logits and decode rates."""
    import torch.distributed as dist
    from benchmarks.gpu_check.gpu_check_decode import decode_rate

    from kvrescue.engine.loader import load_model

    plan = TINY if tiny else FULL
    device, backend = ("cpu", "gloo") if tiny else (f"cuda:{rank}", "nccl")
    if not tiny:
        torch.cuda.set_device(device)
    dist.init_process_group(backend, init_method=f"file://{folder}/rendezvous", rank=rank, world_size=2)
    dtype = "float32" if tiny else "bfloat16"
    sharded = load_model(folder / "model", dtype, device, tp=2, exact_heads=True)
    whole = load_model(folder / "model", dtype, device) if rank == 0 else None
    tokens = torch.randint(0, sharded.args.vocab_size, (2, plan["prompt"]), generator=torch.Generator().manual_seed(0))
    logits = sharded.logits(tokens)
    result: dict = {"shape": f"Qwen2.5-Math-7B layers x{LAYERS}" if not tiny else "tiny", "dtype": dtype,
                    "tp2": {}, "tp1": {}}
    if whole is not None:
        reference = whole.logits(tokens)
        result["logits"] = {"max_abs": (logits - reference).abs().max().item(),
                            "top1_agreement": (logits.argmax(-1) == reference.argmax(-1)).float().mean().item()}
    args = (device, "rkv", plan["budget"], plan["rows"], plan["context"], plan["steps"])
    for mode in ("eager", "graphs") if not tiny else ("eager",):
        for _ in range(plan["rounds"]):  # one device, then two (rank 1 waits), alternating
            for name, model in (("tp1", whole), ("tp2", sharded)):
                dist.barrier()
                if name == "tp2" or model is not None:
                    torch.manual_seed(1)  # both ranks start from the same tokens
                    try:
                        rate = decode_rate(model.net, *args, graphs=mode == "graphs")
                        result[name][mode] = max(result[name].get(mode, 0.0), rate)
                    except Exception as err:  # noqa: BLE001 - record what failed (CUDA graphs over NCCL, say)
                        result[name][mode] = f"failed: {type(err).__name__}: {err}"[:300]
    if rank == 0:
        (folder / "result.json").write_text(json.dumps(result, indent=2))
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiny", action="store_true", help="two CPU processes (gloo), a tiny shape")
    parser.add_argument("--out", type=Path, default=Path("tp_check.json"))
    parser.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--dir", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank is not None:
        torch.set_num_threads(1)
        _rank(args.rank, args.dir, args.tiny)
        return
    if not args.tiny and torch.cuda.device_count() < 2:
        sys.exit("tp_check needs two GPUs (or --tiny for the CPU)")
    start = time.perf_counter()
    result = tp_section(args.tiny)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(describe_tp(result))
    print(f"wrote {args.out} in {time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
    main()
