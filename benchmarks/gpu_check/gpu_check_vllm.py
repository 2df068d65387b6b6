"""gpu_check's `vllm` section: this engine vs vLLM (benchmarks/speed/vs_vllm.py's measures) in a child process."""

from __future__ import annotations

import gc
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.gpu_check.gpu_check_record import Check, RecordLines
from benchmarks.gpu_check.gpu_check_setup import (QWEN25_MATH_7B, QWEN25_MATH_PRM_7B, TINY_VLLM, VLLM_MEMORY,
    VLLM_SHARE, hf_config, random_loaded)
from kvrescue_testkit.random_checkpoints import build_tokenizer

ENTRY = Path(__file__).with_name("gpu_check.py")  # the child runs the entry point with --vllm-child


def vllm_records(dtype: torch.dtype, tiny: bool, plan: dict) -> list[dict]:
    """The vllm section's measurements, in order: decode at each batch size, then PRM scoring."""
    common = {"dtype": str(dtype).removeprefix("torch.")}
    problems, steps, candidates = plan["vllm_prm"]
    return ([{"measure": "decode", "shape": "tiny" if tiny else "Qwen2.5-Math-7B", **common, "batch": batch,
              "new_tokens": plan["vllm_new_tokens"]} for batch in plan["vllm_batches"]]
            + [{"measure": "prm", "shape": "tiny" if tiny else "Qwen2.5-Math-PRM-7B", **common, "problems": problems,
                "steps": steps, "candidates": candidates}])


def vllm_section(check: Check, device: str, dtype: torch.dtype, tiny: bool, plan: dict) -> None:
    """This engine vs vLLM (`vllm_child`), in a child process of its own session: vLLM's start-up does not stop
    for an interrupt, so the child's whole process group is ended at VLLM_SHARE of the budget, keeping the
    records it wrote. Where vLLM is not importable, every record says so."""
    from kvrescue.errors import InputError
    from kvrescue.vllm_engine import require_vllm

    records = vllm_records(dtype, tiny, plan)
    try:
        require_vllm("gpu_check's vllm section")
    except InputError as err:
        for record in records:
            check.add("vllm", {**record, "skipped": str(err)})
        return
    end = check.deadline(VLLM_SHARE)
    gc.collect()  # what earlier sections cached goes back to the device, where vLLM takes its share from
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    with tempfile.TemporaryDirectory(prefix="gpu_check-vllm-") as scratch:
        lines = Path(scratch) / "records.jsonl"
        lines.touch()
        child, received = None, 0
        first = rest = None  # why the first record not received is missing, and why the others are
        if time.perf_counter() < end:
            child = subprocess.Popen([sys.executable, str(ENTRY), "--vllm-child", str(lines), "--device", device]
                                     + (["--tiny"] if tiny else []), start_new_session=True)
        try:
            while child is not None:
                exited = child.poll() is not None
                for line in lines.read_text().split("\n")[received:-1]:  # complete lines only
                    check.add("vllm", json.loads(line))
                    received += 1
                if exited:
                    first = f"failed: the measuring process exited with status {child.returncode}"
                    rest = "not started: the measuring process had exited"
                    break
                if time.perf_counter() > end:
                    first = f"interrupted {end - check.started:.0f} s into the {check.budget_s:.0f} s budget"
                    break
                time.sleep(0.5)
        finally:
            if child is not None:
                end_process_group(child)
        for i, record in enumerate(records[received:]):
            check.add("vllm", {**record, "skipped": (first if i == 0 else rest) or check.late()})


def end_process_group(process: subprocess.Popen) -> None:
    """SIGTERM to the process's group (vLLM's engine shuts down on it), SIGKILL to any member left 10 s later."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            return
        waited = time.perf_counter() + 10
        while time.perf_counter() < waited:
            process.poll()  # reaps the leader once it has ended
            try:
                os.killpg(process.pid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.2)


def vllm_child(out: Path, device: str, dtype: torch.dtype, tiny: bool, plan: dict) -> None:
    """`--vllm-child OUT`: benchmarks/speed/vs_vllm.py's decode and PRM comparisons in the 7B shapes, each record appended
    to `out` as one JSON line as it ends: decode tokens/s of this engine's Runner vs vLLM `generate` with
    `ignore_eos` at each batch, PRM candidates/s of PRMScorer vs VLLMPRMScorer; the same random shape and dtype
    on both sides (vLLM's own random weights, load_format "dummy"). One vLLM engine at a time."""
    from benchmarks.speed.vs_vllm import (best_of_interleaved, chat_prompt, decode_measures, prm_measures,
        prm_workload, vllm_memory)

    from kvrescue.vllm_engine import require_vllm
    from kvrescue.vllm_engine.llm import start_llm

    vllm = require_vllm("gpu_check's vllm section")
    check = RecordLines(out)
    shapes = {"base": TINY_VLLM if tiny else QWEN25_MATH_7B, "prm": TINY_VLLM if tiny else QWEN25_MATH_PRM_7B}
    *decode_records, prm_record = vllm_records(dtype, tiny, plan)
    new, repeats, (problems, steps, candidates) = plan["vllm_new_tokens"], plan["vllm_repeats"], plan["vllm_prm"]
    tokenizer = build_tokenizer(512)
    scratch = Path(tempfile.mkdtemp(prefix="gpu_check-vllm-models-"))
    engines: list = []  # the vLLM engine running now

    def started(role: str, architecture: str, **settings) -> Any:
        engines.append(start_llm(vllm_folder(scratch / role, shapes[role], tokenizer, architecture),
                                 dtype=str(dtype).removeprefix("torch."), load_format="dummy",
                                 enforce_eager=plan["vllm_eager"],
                                 **vllm_memory(device, VLLM_MEMORY, plan["vllm_kv_mib"]), **settings))
        return engines[-1]

    def stop() -> None:
        for llm in engines:
            llm.llm_engine.engine_core.shutdown()
        engines.clear()

    def ratio(ours: float, theirs: float, unit: str) -> dict:
        return {f"engine_{unit}": ours, f"vllm_{unit}": theirs, "engine_over_vllm": ours / theirs}

    built: dict[str, Any] = {}

    def decoding():  # at the first decode measurement: vLLM first, this engine's model in what it leaves
        if built.get("measures") is None:
            if built:
                raise RuntimeError("the first decode measurement did not get both engines ready")
            built["measures"] = None
            prompt = chat_prompt(tokenizer)
            llm = started("base", "Qwen2ForCausalLM", max_model_len=len(prompt) + new + 64)
            model = random_loaded(shapes["base"], device, dtype, 20, tokenizer, "base")
            built["measures"] = decode_measures(model, llm, vllm, prompt, plan["vllm_batches"], new)
        return built["measures"]

    def scoring() -> dict:
        llm = started("prm", "Qwen2ForProcessRewardModel", max_model_len=4096, runner="pooling")
        prm = random_loaded(shapes["prm"], device, dtype, 21, tokenizer, "prm")
        measures, tokens = prm_measures(prm, llm, prm_workload(problems, steps, candidates))
        return {**ratio(*best_of_interleaved(measures, repeats), "candidates_per_s"), "engine_tokens": tokens[0],
                "vllm_tokens": tokens[1]}

    try:
        for record in decode_records:
            check.measure("vllm", record, math.inf, lambda: ratio(
                *best_of_interleaved(decoding(), repeats, record["batch"]), "tokens_per_s"), interrupt=False)
        built.clear()
        stop()
        check.measure("vllm", prm_record, math.inf, scoring, interrupt=False)
    finally:
        stop()
        shutil.rmtree(scratch, ignore_errors=True)


def vllm_folder(folder: Path, shape: dict, tokenizer, architecture: str) -> Path:
    """A model folder vLLM starts on with random weights (load_format "dummy"): `shape`'s config.json and the
    tokenizer, no weights."""
    config = hf_config(shape, tokenizer)
    config.architectures = [architecture]
    config.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder
