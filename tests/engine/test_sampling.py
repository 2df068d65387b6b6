"""Sampling: reproducible, batch-independent, greedy at T=0, top-k/top-p respected, exact entropy."""

import numpy as np
import torch

from kvrescue.engine.sampling import SamplingParams, counter_stages, entropy, sample, stream_key, uniforms


def _logits(rows: int, vocab: int = 300, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 3


def test_reproducible_and_keyed_by_seed_problem_step_candidate() -> None:
    logits = _logits(8)
    keys = [(7, 3, 2, c) for c in range(8)]
    a, _ = sample(logits, keys, [0] * 8)
    b, _ = sample(logits, keys, [0] * 8)
    assert torch.equal(a, b)
    flat = logits[:1].expand(64, -1) / 10
    draws = sample(flat, [(s, 0, 0, 0) for s in range(64)], [0] * 64)[0]
    assert len(set(draws.tolist())) > 3  # different seeds give different streams
    assert stream_key(7, 3, 2, 1) != stream_key(7, 3, 1, 2)


def test_batch_independent() -> None:
    """A row's token depends only on its logits, key and counter, never on the other rows."""
    logits = _logits(16)
    keys = [(1, i, 0, i % 4) for i in range(16)]
    counters = list(range(16))
    together, ent_together = sample(logits, keys, counters)
    for i in range(16):
        alone, ent_alone = sample(logits[i : i + 1], keys[i : i + 1], counters[i : i + 1])
        assert alone.item() == together[i].item()
        assert ent_alone.item() == ent_together[i].item()
    perm = torch.randperm(16, generator=torch.Generator().manual_seed(1)).tolist()
    shuffled, _ = sample(logits[perm], [keys[i] for i in perm], [counters[i] for i in perm])
    assert shuffled.tolist() == [together[i].item() for i in perm]


def test_greedy_at_temperature_zero() -> None:
    logits = _logits(5)
    tokens, _ = sample(logits, [(0, i, 0, 0) for i in range(5)], [0] * 5, SamplingParams(temperature=0))
    assert torch.equal(tokens, logits.argmax(-1))


def test_top_k_and_top_p_respected() -> None:
    logits = _logits(1, seed=3)
    n = 4000
    big = logits.expand(n, -1)
    keys, counters = [(5, 0, 0, 0)] * n, list(range(n))
    tokens, _ = sample(big, keys, counters, SamplingParams(temperature=1.0, top_p=1.0, top_k=5))
    assert set(tokens.tolist()) == set(logits[0].topk(5).indices.tolist())
    probs = torch.softmax(logits[0], -1)
    order = probs.argsort(descending=True)
    nucleus = (probs[order].cumsum(0) - probs[order] < 0.5).sum().item()
    tokens, _ = sample(big, keys, counters, SamplingParams(temperature=1.0, top_p=0.5, top_k=0))
    assert set(tokens.tolist()) == set(order[:nucleus].tolist())
    # Frequencies follow the renormalised distribution.
    kept = probs[order[:nucleus]] / probs[order[:nucleus]].sum()
    freq = torch.tensor([(tokens == t).float().mean().item() for t in order[:nucleus].tolist()])
    assert (freq - kept).abs().max() < 0.04


def test_entropy_is_exact() -> None:
    logits = _logits(6, vocab=1000)
    logits[0, 10:] = float("-inf")  # masked vocabulary entries contribute nothing
    _, ent = sample(logits, [(0, 0, 0, i) for i in range(6)], [0] * 6, SamplingParams(temperature=0.3, top_k=3))
    p = torch.softmax(logits.double(), -1)
    direct = -(p * torch.where(p > 0, p.log(), torch.zeros_like(p))).sum(-1)
    assert (ent.double() - direct).abs().max() < 1e-5
    assert (entropy(torch.zeros(1, 50)) - torch.log(torch.tensor(50.0))).abs().item() < 1e-5


def _fmix32_reference(h: int) -> int:
    h ^= h >> 16
    h = (h * 0x85EBCA6B) & 0xFFFFFFFF
    h ^= h >> 13
    h = (h * 0xC2B2AE35) & 0xFFFFFFFF
    return h ^ (h >> 16)


def _uniform_reference(key: int, counter: int) -> float:
    """Stream version 2 in plain Python integers (unbounded, so no overflow question arises)."""
    h = _fmix32_reference(counter ^ 0x9E3779B9)
    h = _fmix32_reference(h ^ (key & 0xFFFFFFFF))
    h = _fmix32_reference(h ^ (key >> 32))
    return (h >> 8) / 2**24


def test_device_stream_matches_plain_integer_reference() -> None:
    keys = [stream_key(s, i, st, c) for s, i, st, c in [(0, 0, 0, 0), (7, 3, 2, 1), (2**40, 5, 9, 7), (1, 2**31, 0, 3)]]
    keys += [0, (1 << 63) - 1]
    counters = [0, 1, 2**31 - 1, 511, 17, 2**32 - 1]
    got = uniforms(torch.tensor(keys), torch.tensor(counters)).tolist()
    assert got == [_uniform_reference(k, c) for k, c in zip(keys, counters)]
    assert all(0 <= k < 2**63 for k in keys[:4])
    g = torch.Generator().manual_seed(5)
    keys, counters = torch.randint(0, 2**63 - 1, (500,), generator=g), torch.randint(0, 2**32, (500,), generator=g)
    got = uniforms(keys, counters).tolist()
    assert got == [_uniform_reference(k, c) for k, c in zip(keys.tolist(), counters.tolist())]
    counters %= 700  # below the table's limit
    want = [_uniform_reference(k, c) for k, c in zip(keys.tolist(), counters.tolist())]
    assert uniforms(keys, counters, counter_stages(700)).tolist() == want
    # on the host, as a step decoder draws a step's uniforms: numpy arrays, the same float32 values
    on_host = uniforms(keys.numpy(), counters.numpy(), counter_stages(700).numpy())
    assert on_host.dtype == np.float32 and on_host.tolist() == want


def test_stream_is_uniform_enough() -> None:
    u = uniforms(torch.full((20000,), stream_key(3, 1, 4, 1)), torch.arange(20000))
    assert 0 <= u.min() and u.max() < 1
    assert abs(u.mean().item() - 0.5) < 0.01 and abs(u.var().item() - 1 / 12) < 0.003
    across = uniforms(torch.tensor([stream_key(0, i, 0, 0) for i in range(5000)]), torch.zeros(5000, dtype=torch.long))
    assert len(set(across.tolist())) > 4990  # different problems draw different first tokens
