"""gpu_check's `numerics` section: the caches' attention paths on this device against a reference computed another
way, not only their speed. The full cache's paged attention and its cascade (a problem's candidates reading their
shared prefix once, merged by log-sum-exp), flash-attn's paged kernel on a GPU where it is installed, against a
plain causal forward of the same sequences; the bounded cache's static one-token step (CUDA graphs on a GPU), through
compressions, against the dynamic eager step from the same cache state at every step; the full cache's static
forwards of several tokens a row (the PRM's scoring, the commits) against a plain forward."""

from __future__ import annotations

import numpy as np
import torch

from benchmarks.gpu_check.gpu_check_logits import compare, verdict
from benchmarks.gpu_check.gpu_check_record import Check
from benchmarks.gpu_check.gpu_check_setup import QWEN25_05B, TINY, random_engine
from kvrescue.engine.bounded import BoundedCache
from kvrescue.engine.caches import FullCache, block_size_for
from kvrescue.evictor_catalogue import MIN_BUDGET
from kvrescue.engine.graphs import StaticDecode
from kvrescue.engine.model import Transformer
from kvrescue.shapes import ALWAYS_CASCADE, BUFFER

CANDIDATES = 4  # forks per problem
STEPS = 6  # one-token decodes of every fork


def paged_numerics(net: Transformer, device: str, cascade: bool) -> dict:
    """Two problems' prompts (3 blocks + 7 and 3 blocks + 2 tokens) prefilled, CANDIDATES forks of each decoding
    STEPS tokens of their own; each step's logits against a plain forward of every fork's whole sequence."""
    block = block_size_for(next(net.parameters()))
    lengths = [3 * block + 7, 3 * block + 2]
    vocab, rows_n = net.args.vocab_size, len(lengths) * CANDIDATES
    generator = torch.Generator(device).manual_seed(5)
    prompts = torch.randint(0, vocab, (len(lengths), max(lengths)), device=device, generator=generator)
    steps = torch.randint(0, vocab, (rows_n, STEPS), device=device, generator=generator)
    cache = FullCache.for_model(net, rows_n * (max(lengths) + STEPS + 2 * block), max_rows=len(lengths) + rows_n,
                                cascade=ALWAYS_CASCADE if cascade else None)
    with torch.inference_mode():
        parents = [cache.create() for _ in lengths]
        net.prefill(prompts, cache, parents, lengths)
        rows = cache.fork_each(parents, CANDIDATES)
        got = torch.stack([net.decode(steps[:, t], cache, rows).float() for t in range(STEPS)], dim=1)
        owner = np.repeat(np.arange(len(lengths)), CANDIDATES)
        width = max(lengths) + STEPS
        whole = torch.zeros(rows_n, width, dtype=torch.long, device=device)
        for r, p in enumerate(owner):
            whole[r, : lengths[p]] = prompts[p, : lengths[p]]
            whole[r, lengths[p]: lengths[p] + STEPS] = steps[r]
        plain = net(whole).float()
        want = torch.stack([plain[r, lengths[p]: lengths[p] + STEPS] for r, p in enumerate(owner)])
    return {"block_size": block, "comparison": compare(got, want)}


def static_numerics(net: Transformer, device: str) -> dict:
    """A bounded cache (rkv, the smallest budget) holding two prompts longer than B' = B + 128, then BUFFER + 8
    one-token steps through `StaticDecode` (graphs on CUDA), compressing on the way; before each step the state is
    copied into a twin cache, which takes the dynamic eager step, and the two steps' logits are compared."""
    budget, vocab = MIN_BUDGET, net.args.vocab_size
    generator = torch.Generator(device).manual_seed(6)
    prompt = torch.randint(0, vocab, (2, budget + BUFFER + 9), device=device, generator=generator)
    tokens = torch.randint(0, vocab, (BUFFER + 8, 2), device=device, generator=generator)
    static_cache, twin = (BoundedCache.for_model(net, budget, "rkv", max_append=prompt.shape[1], rows=2) for _ in "ab")
    with torch.inference_mode():
        rows = [static_cache.create() for _ in range(2)]
        net.prefill(prompt, static_cache, rows, [prompt.shape[1]] * 2)
        step = StaticDecode(net, static_cache, graphs=device.startswith("cuda"))
        twin.reserve_slot()  # the same pools as the static cache's
        twin_rows = [twin.create() for _ in range(2)]
        got, want, compressions = [], [], 0
        for t in range(len(tokens)):
            for name in ("k", "v", "q"):
                getattr(twin, name).copy_(getattr(static_cache, name))
            for name in ("row_slot", "row_physical", "row_logical", "row_peak"):
                getattr(twin, name)[twin_rows] = getattr(static_cache, name)[rows]
            want.append(net.decode(tokens[t], twin, twin_rows).float())
            before = static_cache.row_physical[rows].copy()
            got.append(step(rows, tokens[t]).float())
            compressions += int((static_cache.row_physical[rows] < before).any())
    return {"budget": budget, "steps": len(tokens), "compressions": compressions,
            "cuda_graphs": step.graphs, "comparison": compare(torch.stack(got), torch.stack(want))}


def append_numerics(net: Transformer, device: str) -> dict:
    """Two problems' prompts prefilled into a full cache, CANDIDATES forks of each, then two rounds of 1 to 9 tokens
    appended to every fork in one static forward each (`StaticDecode.append`, CUDA graphs on a GPU: the PRM's
    scoring, the commits of whole steps; padding rows and tokens); the head after each fork's last token against a
    plain forward of its whole sequence."""
    block = block_size_for(next(net.parameters()))
    lengths, vocab = [3 * block + 7, 3 * block + 2], net.args.vocab_size
    rows_n = len(lengths) * CANDIDATES - 1  # a padding row in the bucket
    generator = torch.Generator(device).manual_seed(8)
    prompts = torch.randint(0, vocab, (len(lengths), max(lengths)), device=device, generator=generator)
    cache = FullCache.for_model(net, rows_n * (max(lengths) + 20 + 2 * block), max_rows=len(lengths) + rows_n + 1)
    step = StaticDecode(net, cache, graphs=device.startswith("cuda"))  # before any row holds a block
    owner = np.repeat(np.arange(len(lengths)), CANDIDATES)[:rows_n]
    sequences = [prompts[p, : lengths[p]].tolist() for p in owner]
    got, want = [], []
    with torch.inference_mode():
        parents = [cache.create() for _ in lengths]
        net.prefill(prompts, cache, parents, lengths)
        rows = cache.fork_each(parents, CANDIDATES)[:rows_n]
        for shift in (0, 4):
            appended = [torch.randint(0, vocab, (1 + (3 * r + shift) % 9,), generator=generator,
                                      device=device).tolist() for r in range(rows_n)]
            got.append(step.append(rows, appended).float())
            sequences = [s + a for s, a in zip(sequences, appended)]
            whole = torch.zeros(rows_n, max(map(len, sequences)), dtype=torch.long, device=device)
            for r, sequence in enumerate(sequences):
                whole[r, : len(sequence)] = torch.tensor(sequence, device=device)
            plain = net(whole).float()
            want.append(torch.stack([plain[r, len(sequence) - 1] for r, sequence in enumerate(sequences)]))
    return {"buckets": len(step.steps), "cuda_graphs": step.graphs,
            "comparison": compare(torch.stack(got), torch.stack(want))}


def numerics_section(check: Check, device: str, dtype: torch.dtype, tiny: bool) -> None:
    """Paged, cascade and static-step numerics on one random model (the tiny shape, else Qwen2.5-0.5B's)."""
    built: dict[str, Transformer] = {}

    def net() -> Transformer:
        if not built:
            built["net"] = random_engine(TINY if tiny else QWEN25_05B, device, dtype, seed=7)
        return built["net"]

    common = {"shape": "tiny" if tiny else "Qwen2.5-0.5B", "dtype": str(dtype).removeprefix("torch.")}
    measures = {"paged": lambda: paged_numerics(net(), device, cascade=False),
                "cascade": lambda: paged_numerics(net(), device, cascade=True),
                "static": lambda: static_numerics(net(), device),
                "static appends": lambda: append_numerics(net(), device)}
    for path, measure in measures.items():
        check.measure("numerics", {"path": path, **common}, check.deadline(1.0),
                      lambda: (lambda r: {**r, **verdict(dtype, [r["comparison"]])})(measure()))
