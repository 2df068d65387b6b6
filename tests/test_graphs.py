"""The static-shape decode step (what CUDA graphs capture on a GPU), run eagerly on the CPU against the dynamic one."""

import pytest
import torch

from kvrescue_cli.engine.bounded import BoundedCache
from kvrescue_cli.engine.graphs import StaticDecode, bucket
from kvrescue_cli.engine.loader import load_model

pytestmark = pytest.mark.usefixtures("kernel_layouts")  # each test also under CUDA's kernel layouts


def test_buckets_are_powers_of_two():
    assert [bucket(r) for r in (1, 2, 3, 4, 5, 64, 65, 513)] == [1, 2, 4, 4, 8, 64, 128, 1024]


def test_static_decode_matches_the_dynamic_step_through_compressions_forks_and_releases(qwen2_dir):
    model = load_model(qwen2_dir)
    net = model.net
    generator = torch.Generator().manual_seed(0)
    dynamic = BoundedCache.for_model(net, budget=16, policy="rkv", max_append=40, rows=4)
    static = BoundedCache.for_model(net, budget=16, policy="rkv", max_append=40, rows=4)
    step = StaticDecode(net, static, graphs=True)  # no CUDA here: the same static step, eagerly
    assert static.k.shape[1] == 5  # the scratch slot comes on top of the rows the cache was sized for
    lengths = [5, 20, 33]
    prompt = torch.randint(0, net.args.vocab_size, (3, max(lengths)), generator=generator)
    rows = {}
    for name, cache in (("dynamic", dynamic), ("static", static)):
        rows[name] = [cache.create() for _ in lengths]
        net.prefill(prompt, cache, rows[name], lengths)
    for t in range(150):  # B' = 144: every row is compressed at least once
        if t == 60:  # fork the first row, release the last, as a step commit does
            for name, cache in (("dynamic", dynamic), ("static", static)):
                children = cache.fork(rows[name][0], 2)
                cache.release([rows[name].pop()])
                rows[name] += children
        tokens = torch.randint(0, net.args.vocab_size, (len(rows["dynamic"]),), generator=generator)
        with torch.inference_mode():
            want = net.decode(tokens, dynamic, rows["dynamic"])
        got = step(rows["static"], tokens.tolist())
        torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)
    for a, b in zip(rows["dynamic"], rows["static"]):
        assert dynamic.physical_length(a) == static.physical_length(b)
        assert dynamic.length(a) == static.length(b) and dynamic.peak_length(a) == static.peak_length(b)
        n = dynamic.physical_length(a)
        torch.testing.assert_close(static.k[:, static.slot(b), :, :n], dynamic.k[:, dynamic.slot(a), :, :n])
    assert max(static.physical_length(r) for r in rows["static"]) < static.trigger


def reference_flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens, cache_batch_idx):
    """flash-attn's documented semantics, in plain torch: q [B, 1, Hq, D], caches [slots, S, Hkv, D], row b
    attends over the first cache_seqlens[b] entries of slot cache_batch_idx[b]; query head h uses KV head h // g."""
    out = []
    for b in range(q.shape[0]):
        n, slot = int(cache_seqlens[b]), int(cache_batch_idx[b])
        g = q.shape[2] // k_cache.shape[2]
        k = k_cache[slot, :n].repeat_interleave(g, dim=1).transpose(0, 1)  # [Hq, n, D]
        v = v_cache[slot, :n].repeat_interleave(g, dim=1).transpose(0, 1)
        weights = (q[b, 0][:, None] @ k.transpose(1, 2) / q.shape[-1] ** 0.5).softmax(-1)  # [Hq, 1, n]
        out.append((weights @ v)[:, 0])
    return torch.stack(out)[:, None]


def test_the_flash_attn_call_matches_the_dynamic_step(qwen2_dir, monkeypatch, kernel_layouts):
    """The flash-attn path only runs on a GPU with flash-attn installed; its call (layouts, lengths, slots) is
    checked here against a plain-torch implementation of flash_attn_with_kvcache's semantics."""
    from kvrescue_cli.engine import graphs

    monkeypatch.setattr(graphs, "flash_attn_with_kvcache", kernel_layouts.flash(reference_flash_attn_with_kvcache))
    monkeypatch.setattr(graphs, "use_flash", lambda q: True)
    net = load_model(qwen2_dir).net
    generator = torch.Generator().manual_seed(1)
    dynamic = BoundedCache.for_model(net, budget=16, policy="rkv", max_append=40, rows=4)
    static = BoundedCache.for_model(net, budget=16, policy="rkv", max_append=40, rows=4)
    step = StaticDecode(net, static, graphs=False)
    prompt = torch.randint(0, net.args.vocab_size, (3, 30), generator=generator)
    rows = {}
    for name, cache in (("dynamic", dynamic), ("static", static)):
        rows[name] = [cache.create() for _ in range(3)]
        net.prefill(prompt, cache, rows[name], [7, 30, 19])
    for _ in range(120):  # through a compression of the longest row
        tokens = torch.randint(0, net.args.vocab_size, (3,), generator=generator)
        with torch.inference_mode():
            want = net.decode(tokens, dynamic, rows["dynamic"])
        torch.testing.assert_close(step(rows["static"], tokens.tolist()), want, atol=2e-5, rtol=1e-5)
