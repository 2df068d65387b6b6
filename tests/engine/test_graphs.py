"""The static-shape decode step (what CUDA graphs capture on a GPU), run eagerly on the CPU against the dynamic one."""

import numpy as np
import pytest
import torch

from kvrescue.engine.bounded import BoundedCache
from kvrescue.engine.caches import FullCache
from kvrescue.engine.evictors.registry import make_evictor
from kvrescue.evictor_catalogue import parse_evictor
from kvrescue.engine.graphs import StaticDecode
from kvrescue.engine.loader import load_model
from kvrescue.shapes import bucket
from tests.dispatched import Dispatched

pytestmark = pytest.mark.usefixtures("kernel_layouts")  # each test also under CUDA's kernel layouts


def test_buckets_are_powers_of_two():
    assert [bucket(r) for r in (1, 2, 3, 4, 5, 64, 65, 513)] == [1, 2, 4, 4, 8, 64, 128, 1024]


@pytest.mark.parametrize("slots_per_row", [3, 0], ids=["in-place", "gathered"])  # graphs.IN_PLACE_SLOTS
@pytest.mark.parametrize("evictor", ["rkv", "h2o", "pyramidkv:beta=2", "adakv:scores=snapkv"])
def test_static_decode_matches_the_dynamic_step_through_compressions_forks_and_releases(qwen2_dir, evictor,
                                                                                        slots_per_row, monkeypatch):
    """Without flash-attn, the static step reads every slot's span in place or the rows' spans gathered; with an
    allocating evictor (ragged per-layer or per-head lengths, holes masked) gathered."""
    from kvrescue.engine import graphs

    monkeypatch.setattr(graphs, "IN_PLACE_SLOTS", slots_per_row)
    model = load_model(qwen2_dir)
    net = model.net
    generator = torch.Generator().manual_seed(0)
    policy = make_evictor(*parse_evictor(evictor))
    dynamic = BoundedCache.for_model(net, budget=16, evictor=policy, max_append=40, rows=4)
    static = BoundedCache.for_model(net, budget=16, evictor=policy, max_append=40, rows=4)
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
        assert (dynamic.row_held[a] == static.row_held[b]).all() and dynamic.row_base[a] == static.row_base[b]
        assert dynamic.length(a) == static.length(b) and dynamic.peak_length(a) == static.peak_length(b)
        n = dynamic.physical_length(a)
        torch.testing.assert_close(static.k[:, static.slot(b), :, :n], dynamic.k[:, dynamic.slot(a), :, :n])
        if evictor == "h2o":  # the attention each entry received, accumulated by both steps alike
            torch.testing.assert_close(static.received[:, static.slot(b), :, :n],
                                       dynamic.received[:, dynamic.slot(a), :, :n], rtol=1e-5, atol=1e-6)
    assert max(static.physical_length(r) for r in rows["static"]) < static.trigger
    ragged = [len(np.unique(static.row_held[r])) > 1 for r in rows["static"]]
    assert all(ragged) if policy.allocates else not any(ragged)


def reference_flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens, cache_batch_idx, num_splits=0):
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
    from kvrescue.engine import graphs

    monkeypatch.setattr(graphs, "flash_attn_with_kvcache", kernel_layouts.flash(reference_flash_attn_with_kvcache))
    monkeypatch.setattr(graphs, "use_flash", lambda q: True)
    net = load_model(qwen2_dir).net
    generator = torch.Generator().manual_seed(1)
    dynamic = BoundedCache.for_model(net, budget=16, evictor="rkv", max_append=40, rows=4)
    static = BoundedCache.for_model(net, budget=16, evictor="rkv", max_append=40, rows=4)
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


class CachingAllocator:
    """The pools of one cache allocated as CUDA's caching allocator would: from blocks it keeps, a freed pool's block
    handed to the next pool that fits (the lowest such block first), so a regrown pool can land where an old one was.
    Serves the cache's growths (`Tensor.new_zeros` on its pools)."""

    BLOCK = 1 << 20  # elements per block

    def __init__(self, cache: BoundedCache, monkeypatch) -> None:
        self.cache, self.blocks = cache, []
        new_zeros = torch.Tensor.new_zeros

        def allocate(tensor, *size, **kwargs):
            if not any(tensor is getattr(cache, name) for name in ("k", "v", "q")):
                return new_zeros(tensor, *size, **kwargs)
            shape = torch.Size(size[0] if len(size) == 1 and not isinstance(size[0], int) else size)
            held = {getattr(cache, name).data_ptr() for name in ("k", "v", "q")}
            block = next((b for b in self.blocks if b.data_ptr() not in held), None)
            if block is None:
                block = torch.empty(self.BLOCK, dtype=tensor.dtype)
                self.blocks.append(block)
            assert shape.numel() <= self.BLOCK
            return block[: shape.numel()].view(shape).zero_()

        monkeypatch.setattr(torch.Tensor, "new_zeros", allocate)

    def at(self, address: int) -> torch.Tensor:
        """The block starting at `address`."""
        (block,) = [b for b in self.blocks if b.data_ptr() == address]
        return block


class PointerGraph:
    """What replaying a CUDA graph does, on the CPU: the step captured once, then rerun on the pools' memory at the
    addresses and with the strides they had at capture, whatever lies there now."""

    def __init__(self, decode: StaticDecode, inputs: torch.Tensor, allocator: CachingAllocator) -> None:
        self.decode, self.inputs, self.allocator = decode, inputs, allocator
        pools = {name: getattr(decode.cache, name) for name in ("k", "v", "q")}
        self.pools = {name: (t.data_ptr(), t.shape, t.stride()) for name, t in pools.items()}
        self.logits = decode._forward(inputs)

    def replay(self) -> None:
        cache = self.decode.cache
        now = {name: getattr(cache, name) for name in self.pools}
        try:
            for name, (address, shape, stride) in self.pools.items():
                setattr(cache, name, self.allocator.at(address).as_strided(shape, stride))
            self.logits.copy_(self.decode._forward(self.inputs))
        finally:
            for name, pool in now.items():
                setattr(cache, name, pool)


class PointerGraphs(StaticDecode):
    """StaticDecode with its steps captured in `PointerGraph`s: its graph bookkeeping, run on the CPU."""

    def __init__(self, net, cache: BoundedCache, allocator: CachingAllocator) -> None:
        super().__init__(net, cache, graphs=False)
        self.graphs, self.allocator = True, allocator

    def _warm_up(self, inputs: torch.Tensor, tokens: int) -> torch.Tensor:
        logits = self._forward(inputs, tokens)  # on the current stream: the CPU has one
        self.outputs[inputs.shape[1], tokens] = torch.empty_like(logits)
        return logits

    def _capture(self, inputs: torch.Tensor, tokens: int = 1) -> tuple[PointerGraph, torch.Tensor]:
        graph = PointerGraph(self, inputs, self.allocator)
        return graph, graph.logits


def test_graphs_are_captured_again_when_the_pools_regrew_even_at_the_same_address(qwen2_dir, monkeypatch):
    """Four growths of the pools between two steps bring the K pool back to the block it had at capture, with
    other strides (more rows): the step must be captured again, not replayed on what now lies there."""
    net = load_model(qwen2_dir).net
    generator = torch.Generator().manual_seed(2)
    dynamic = BoundedCache.for_model(net, budget=16, evictor="rkv", max_append=40, rows=4)
    static = BoundedCache.for_model(net, budget=16, evictor="rkv", max_append=40, rows=4)
    allocator = CachingAllocator(static, monkeypatch)
    step = PointerGraphs(net, static, allocator)  # the scratch slot: the pools' first growth, into blocks
    captured_at = static.k.data_ptr()
    prompt = torch.randint(0, net.args.vocab_size, (3, 20), generator=generator)
    rows = {}
    for name, cache in (("dynamic", dynamic), ("static", static)):
        rows[name] = [cache.create() for _ in range(3)]
        net.prefill(prompt, cache, rows[name], [20, 9, 14])

    def decode(steps: int) -> None:
        for _ in range(steps):
            tokens = torch.randint(0, net.args.vocab_size, (3,), generator=generator)
            with torch.inference_mode():
                want = net.decode(tokens, dynamic, rows["dynamic"])
            torch.testing.assert_close(step(rows["static"], tokens.tolist()), want, atol=2e-5, rtol=1e-5)

    decode(3)
    assert step.steps[4,].graph is not None  # warmed up, then captured and replayed twice
    growths = static.generation
    extra = []
    while static.generation < growths + 4:  # rows 5 -> 10 -> 20 -> 40 -> 80
        extra += [(dynamic.create(), static.create())]
    assert static.k.data_ptr() == captured_at and static.k.stride() != step.steps[4,].graph.pools["k"][2]
    dynamic.release([d for d, _ in extra])
    static.release([s for _, s in extra])
    decode(3)


@pytest.mark.parametrize("block_size", [4, 16])
def test_the_full_caches_static_decode_matches_the_dynamic_step_through_forks_copies_and_releases(qwen2_dir, block_size):
    """The full cache's static step (row and block buckets, block tables padded, a scratch block for the padding
    rows) against `net.decode` on an equal cache: forks share blocks, the first write into a shared partly filled
    block copies it, released rows free theirs."""
    net = load_model(qwen2_dir).net
    generator = torch.Generator().manual_seed(4)
    caches = {name: FullCache.for_model(net, 2048, max_rows=16, max_row_tokens=256, block_size=block_size)
              for name in ("dynamic", "static")}
    step = StaticDecode(net, caches["static"], graphs=True)  # no CUDA here: the same static step, eagerly
    assert caches["static"].num_blocks == caches["dynamic"].num_blocks + 1  # the scratch block comes on top
    lengths = [5, 21, 34]
    prompt = torch.randint(0, net.args.vocab_size, (3, max(lengths)), generator=generator)
    rows = {}
    for name, cache in caches.items():
        rows[name] = [cache.create() for _ in lengths]
        net.prefill(prompt, cache, rows[name], lengths)
    for t in range(70):  # the longest row from 3 to 7 blocks of 16, 9 to 26 of 4
        if t in (10, 40):  # fork the first row (into a partly filled block), release the last
            for name, cache in caches.items():
                children = cache.fork(rows[name][0], 3)
                cache.release([rows[name].pop()])
                rows[name] += children
        tokens = torch.randint(0, net.args.vocab_size, (len(rows["dynamic"]),), generator=generator)
        with torch.inference_mode():
            want = net.decode(tokens, caches["dynamic"], rows["dynamic"])
        torch.testing.assert_close(step(rows["static"], tokens), want, atol=2e-5, rtol=1e-5)
    assert {key[0] for key in step.steps} == {4, 8}  # row buckets of 3, 5 and 7 rows
    def keys(name: str, row: int) -> torch.Tensor:
        cache = caches[name]
        return cache.k[:, cache.blocks(row)].flatten(1, 2)[:, : cache.length(row)]

    for a, b in zip(rows["dynamic"], rows["static"]):
        torch.testing.assert_close(keys("static", b), keys("dynamic", a))
    assert caches["static"].blocks_in_use() == caches["dynamic"].blocks_in_use() + 1



def test_the_full_caches_flash_attn_call_matches_the_dynamic_step(qwen2_dir, monkeypatch, kernel_layouts):
    """With flash-attn the full cache's static step reads the whole block table in place (`attend_paged`'s paged
    call); checked against the dynamic step through a plain-torch implementation of its semantics."""
    from kvrescue.engine import attention, graphs
    from tests.engine import test_attention

    monkeypatch.setattr(attention, "flash_attn_with_kvcache",
                        kernel_layouts.flash(test_attention.reference_flash_attn_with_kvcache))
    monkeypatch.setattr(attention, "use_flash", lambda x: True)
    monkeypatch.setattr(attention, "FLASH_BLOCK", 8)
    monkeypatch.setattr(graphs, "use_flash", lambda x: True)
    net = load_model(qwen2_dir).net
    generator = torch.Generator().manual_seed(5)
    caches = {name: FullCache.for_model(net, 1024, max_rows=8, max_row_tokens=128, block_size=8)
              for name in ("dynamic", "static")}
    step = StaticDecode(net, caches["static"], graphs=False)
    prompt = torch.randint(0, net.args.vocab_size, (2, 19), generator=generator)
    rows = {}
    for name, cache in caches.items():
        rows[name] = [cache.create() for _ in range(2)]
        net.prefill(prompt, cache, rows[name], [19, 6])
        rows[name] += cache.fork(rows[name][0], 2)
    for _ in range(20):
        tokens = torch.randint(0, net.args.vocab_size, (4,), generator=generator)
        with torch.inference_mode():
            want = net.decode(tokens, caches["dynamic"], rows["dynamic"])
        torch.testing.assert_close(step(rows["static"], tokens), want, atol=2e-5, rtol=1e-5)
    assert {key[1] for key in step.steps} == {16}  # the table's whole width: 128 tokens in blocks of 8


@pytest.mark.parametrize("kind", ["full", "bounded"])
def test_a_step_of_fewer_rows_takes_a_bucket_prepared_already(qwen2_dir, kind):
    """A step of 2 rows after steps of 4 (a commit after the candidates' steps) is padded into the prepared bucket of 4
    rows (as wide a block table or wider), not a bucket of its own (on a GPU: a warm-up and a capture forward); the
    same outputs as the dynamic step."""
    net = load_model(qwen2_dir).net
    make = {"full": lambda: FullCache.for_model(net, 2048, max_rows=16, max_row_tokens=256, block_size=4),
            "bounded": lambda: BoundedCache.for_model(net, budget=16, evictor="rkv", max_append=40, rows=4)}[kind]
    caches = {"dynamic": make(), "static": make()}
    step = StaticDecode(net, caches["static"], graphs=True)  # no CUDA here: the same static step, eagerly
    generator = torch.Generator().manual_seed(5)
    lengths = [9, 6, 13, 4]
    prompt = torch.randint(0, net.args.vocab_size, (4, max(lengths)), generator=generator)
    rows = {}
    for name, cache in caches.items():
        rows[name] = [cache.create() for _ in lengths]
        net.prefill(prompt, cache, rows[name], lengths)
    for picked in (slice(None), slice(None), slice(1, 3), slice(0, 1)):
        tokens = torch.randint(0, net.args.vocab_size, (len(rows["dynamic"][picked]),), generator=generator)
        with torch.inference_mode():
            want = net.decode(tokens, caches["dynamic"], rows["dynamic"][picked])
        torch.testing.assert_close(step(rows["static"][picked], tokens), want, atol=2e-5, rtol=1e-5)
    assert [key[0] for key in step.steps] == [4]


@pytest.mark.parametrize("kind", ["full", "bounded in place", "bounded gathered", "bounded dynamic"])
def test_a_steps_attention_mask_is_laid_out_once_for_all_layers(qwen2_dir, kind, monkeypatch):
    """The attention of a decode step (the full or bounded cache's static one, its slots read in place or its rows'
    spans gathered, or the bounded cache's dynamic one) builds its mask with the first layer: every later layer
    dispatches fewer ops than the first, and all of them the same."""
    from kvrescue.engine import graphs

    monkeypatch.setattr(graphs, "IN_PLACE_SLOTS", 0 if kind == "bounded gathered" else 3)
    net = load_model(qwen2_dir).net
    if kind == "full":
        cache, view = FullCache.for_model(net, 2048, max_rows=8, max_row_tokens=256, block_size=4), graphs._FullView
    else:
        cache = BoundedCache.for_model(net, budget=16, evictor="rkv", max_append=40, rows=4)
        view = BoundedCache if kind == "bounded dynamic" else graphs._StaticView
    layers = []

    def attend(self, layer, q, k, v, attend=view.attend):
        with Dispatched() as dispatched:
            out = attend(self, layer, q, k, v)
        layers.append(len(dispatched.ops))
        return out

    step = StaticDecode(net, cache, graphs=True)  # no CUDA here: the same static step, eagerly
    rows = [cache.create() for _ in range(3)]
    net.prefill(torch.arange(30).view(3, 10) % net.args.vocab_size, cache, rows, [10, 7, 4])
    monkeypatch.setattr(view, "attend", attend)
    tokens = torch.tensor([1, 2, 3])
    with torch.inference_mode():
        net.decode(tokens, cache, rows) if kind == "bounded dynamic" else step(rows, tokens)
    assert len(layers) == net.args.n_layers > 1
    assert layers[0] > layers[1] and len(set(layers[1:])) == 1, layers


def test_a_bounded_static_steps_layer_reads_its_pools_without_selecting_them(qwen2_dir, monkeypatch):
    """A layer of the bounded cache's static step reads its K, V and query pools through the views the cache made
    when it allocated them (`caches.layer_views`): it selects only the new token's k and v, 2 selects where it took
    7 and then 5 (each pool taken out of all layers' every step); the step still equals the dynamic decode."""
    from kvrescue.engine import graphs

    net = load_model(qwen2_dir).net
    caches = [BoundedCache.for_model(net, budget=16, evictor="rkv", max_append=40, rows=4) for _ in range(2)]
    rows = [[cache.create() for _ in range(3)] for cache in caches]
    for cache, its in zip(caches, rows):
        net.prefill(torch.arange(30).view(3, 10) % net.args.vocab_size, cache, its, [10, 7, 4])
    layers = []

    def attend(self, layer, q, k, v, attend=graphs._StaticView.attend):
        with Dispatched() as counted:
            out = attend(self, layer, q, k, v)
        layers.append(counted.ops.count("select"))
        return out

    monkeypatch.setattr(graphs._StaticView, "attend", attend)
    tokens = torch.tensor([1, 2, 3])
    got = StaticDecode(net, caches[0], graphs=True)(rows[0], tokens)
    with torch.inference_mode():
        want = net.decode(tokens, caches[1], rows[1])
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)
    assert layers == [2] * net.args.n_layers
