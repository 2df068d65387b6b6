"""The static-shape decode step (what CUDA graphs capture on a GPU), run eagerly on the CPU against the dynamic one."""

import torch

from kvrescue_cli.engine.bounded import BoundedCache
from kvrescue_cli.engine.graphs import StaticDecode, bucket
from kvrescue_cli.engine.loader import load_model


def test_buckets_are_powers_of_two():
    assert [bucket(r) for r in (1, 2, 3, 4, 5, 64, 65, 513)] == [1, 2, 4, 4, 8, 64, 128, 1024]


def test_static_decode_matches_the_dynamic_step_through_compressions_forks_and_releases(qwen2_dir):
    model = load_model(qwen2_dir)
    net = model.net
    generator = torch.Generator().manual_seed(0)
    for policy in ("rkv", "streaming", "none"):
        dynamic = BoundedCache.for_model(net, budget=16, policy=policy, max_append=40, rows=4)
        static = BoundedCache.for_model(net, budget=16, policy=policy, max_append=40, rows=4)
        step = StaticDecode(net, static, graphs=True)  # no CUDA here: the same static step, eagerly
        lengths = [5, 20, 33]
        prompt = torch.randint(0, net.args.vocab_size, (3, max(lengths)), generator=generator)
        rows = {}
        for name, cache in (("dynamic", dynamic), ("static", static)):
            rows[name] = [cache.create() for _ in lengths]
            net.prefill(prompt, cache, rows[name], lengths)
        for t in range(170):  # B' = 144: every row is compressed at least once
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
        if policy != "none":
            assert max(static.physical_length(r) for r in rows["static"]) < static.trigger
