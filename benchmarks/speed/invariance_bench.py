"""What batch invariance (`--deterministic`, engine/invariance.py) costs in decode tokens/s on this machine.

    python benchmarks/speed/invariance_bench.py [--threads 1] [--new-tokens 32] [--repeats 2]

A random checkpoint of SmolLM2-135M's shapes in bf16 decodes one-token steps of `batch` rows (1, 8, 32) over the
base's bounded cache (budget 128, buffer 128, a 200-token prompt, rows forked from it), sampling every token,
with the mode off (today's kernels) and on, alternating in one run, best of --repeats; the ratio is on / off.
"""

import argparse
import tempfile
import time

import torch

from kvrescue.engine import invariance, load_model
from kvrescue.engine.bounded import BoundedCache
from kvrescue.engine.sampling import SamplingParams, sample
from kvrescue.engine.steps import append_tokens
from kvrescue_testkit.random_checkpoints import write_random_checkpoint

SMOLLM2 = dict(hidden_size=576, num_layers=30, num_heads=9, num_kv_heads=3, intermediate_size=1536,
               vocab_size=49152)


@torch.inference_mode()
def decode_seconds(model, batch: int, new: int) -> float:
    cache = BoundedCache.for_model(model.net, 128, rows=batch + 1)
    parent = cache.create()
    logits = append_tokens(model, cache, [parent], [list(range(3, 203))])
    rows = cache.fork(parent, batch)
    current = logits.expand(batch, -1)
    keys = [(0, 0, 0, c) for c in range(batch)]
    start = time.perf_counter()
    for i in range(new):
        tokens, _ = sample(current, keys, [i] * batch, SamplingParams())
        current = model.net.decode(tokens, cache, rows).float()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as folder:
        write_random_checkpoint(folder, "llama", **SMOLLM2, tokenizer_vocab=512)
        model = load_model(folder, "bfloat16")
    print(f"decode tokens/s, SmolLM2 shapes, bf16, {args.threads} thread(s), {args.new_tokens} tokens per row")
    print("batch   off     on   on/off")
    for batch in (1, 8, 32):
        best = {False: float("inf"), True: float("inf")}
        for mode in [False, True] * (args.repeats + 1):  # the first pair warms up
            invariance.enable(mode)
            best[mode] = min(best[mode], decode_seconds(model, batch, args.new_tokens))
        invariance.enable(False)
        off, on = (batch * args.new_tokens / best[m] for m in (False, True))
        print(f"{batch:5d} {off:6.1f} {on:6.1f}  {on / off:5.2f}", flush=True)


if __name__ == "__main__":
    main()
