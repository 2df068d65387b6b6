"""The bounded evicting cache on a tiny random Qwen2 loaded through the real loader."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from kvrescue.engine.bounded import BoundedCache
from kvrescue.engine.caches import FullCache
from kvrescue.engine.graphs import StaticDecode
from kvrescue.engine.evictors.adakv import AdaKV
from kvrescue.engine.evictors.base import gather_positions
from kvrescue.engine.evictors.pyramidkv import PyramidKV
from kvrescue.engine.evictors.registry import keep_positions
from kvrescue.engine.evictors.rkv import RKV
from kvrescue.engine.evictors.snapkv import SnapKV
from kvrescue.shapes import OBSERVATION_WINDOW
from kvrescue.engine.loader import load_model
from kvrescue_testkit.random_checkpoints import write_random_checkpoint
from tests.conftest import TINY
from tests.oracles import adakv_keep_past, rkv_keep, snapkv_keep, streaming_keep

pytestmark = pytest.mark.usefixtures("kernel_layouts")  # each test also under CUDA's kernel layouts


@pytest.fixture(scope="module")
def net(qwen2_dir):
    return load_model(qwen2_dir).net


@pytest.fixture(scope="module")
def one_layer_net(tmp_path_factory):
    """A one-layer model: the pools' layer dimension has size 1 (a fork once wrote from a view of its target)."""
    folder = write_random_checkpoint(tmp_path_factory.mktemp("one_layer"), "qwen2", seed=4, **{**TINY, "num_layers": 1})
    return load_model(folder).net


def rows_in_use(cache: BoundedCache) -> list[int]:
    """The ids of the cache's rows created and not released."""
    return sorted(set(range(cache.next_id)) - set(cache.free_ids))


def prompt(n: int, seed: int = 0) -> list[int]:
    return torch.randint(10, 250, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


class Driver:
    """Runs the same sequence of cache operations on a cache, recording every row's logits and tokens."""

    def __init__(self, net, cache) -> None:
        self.net, self.cache = net, cache
        self.logits: list[torch.Tensor] = []

    @torch.inference_mode()
    def append(self, rows: list[int], seqs: list[list[int]]) -> torch.Tensor:
        T = max(len(s) for s in seqs)
        tokens = torch.tensor([s + [0] * (T - len(s)) for s in seqs])
        out = self.net.prefill(tokens, self.cache, rows, [len(s) for s in seqs])
        self.logits.append(out)
        return out.argmax(-1)

    @torch.inference_mode()
    def greedy(self, rows: list[int], first: torch.Tensor, steps: int) -> list[list[int]]:
        tokens, out = first, [[] for _ in rows]
        for _ in range(steps):
            for o, t in zip(out, tokens.tolist()):
                o.append(t)
            logits = self.net.decode(tokens, self.cache, rows)
            self.logits.append(logits)
            tokens = logits.argmax(-1)
        return out


def scenario(net, cache, *, decode: int = 30, step: int = 15) -> tuple[list[list[int]], list[torch.Tensor]]:
    """Prompt, greedy decode, fork into three candidates that diverge, a multi-token helper step
    appended to one, adopt it, keep decoding, fork again; returns the tokens and every logits tensor."""
    d = Driver(net, cache)
    root = cache.create()
    first = d.append([root], [prompt(20)])
    toks = d.greedy([root], first, decode)
    kids = cache.fork(root, 3)
    firsts = d.append(kids, [[101], [102, 103], [104, 105, 106, 107]])
    toks += d.greedy(kids, firsts, decode)
    helper_step = prompt(step, seed=1)
    d.append([kids[1]], [helper_step])
    cache.adopt(root, kids[1])
    cache.release([kids[0], kids[2]])
    toks += d.greedy([root], torch.tensor([7]), decode)
    kids = cache.fork(root, 2)  # reuses freed slots out of order: a non-consecutive batch
    toks += d.greedy(kids, d.append(kids, [[9], [8, 7]]), decode // 2)
    return toks, d.logits


def test_without_compression_decoding_equals_full_cache(net):
    full_toks, full_logits = scenario(net, FullCache.for_model(net, 4096))
    cache = BoundedCache.for_model(net, budget=64)  # B' = 192 > every sequence here: no row compresses
    toks, logits = scenario(net, cache)
    assert toks == full_toks
    for a, b in zip(logits, full_logits):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_pools_that_grow_in_rows_and_capacity_keep_every_row_as_the_full_cache_does(net):
    full_toks, full_logits = scenario(net, FullCache.for_model(net, 8192), decode=60, step=200)
    # one slot and 64 entries to start with; B' = 640 is never reached, so only the growths can differ
    cache = BoundedCache.for_model(net, budget=512, rows=1, capacity=64)
    toks, logits = scenario(net, cache, decode=60, step=200)
    assert toks == full_toks
    for a, b in zip(logits, full_logits):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    assert cache.capacity >= 20 + 3 * 60 + 4 + 200
    assert cache.k.shape[1] >= 4
    assert all(cache.peak_length(r) == cache.physical_length(r) == cache.length(r) for r in rows_in_use(cache))


def test_an_append_longer_than_the_room_grows_the_buffer(net):
    cache = BoundedCache.for_model(net, budget=16, max_append=8)  # room for 152 entries
    full = FullCache.for_model(net, 4096)
    ids = prompt(300)
    drivers = [Driver(net, c) for c in (cache, full)]
    for d in drivers:
        d.append([d.cache.create()], [ids])
    torch.testing.assert_close(drivers[0].logits[0], drivers[1].logits[0], rtol=1e-4, atol=1e-5)
    assert cache.capacity == 320 and cache.physical_length(0) == 16 and cache.peak_length(0) == 300


@pytest.mark.parametrize("buffer", [128, 16], ids=["W128", "W16"])
@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
def test_a_row_is_compressed_exactly_when_it_reaches_b_prime(net, static, buffer):
    budget = 16
    b_prime = budget + buffer
    cache = BoundedCache.for_model(net, budget=budget, max_append=8, buffer=buffer)
    d = Driver(net, cache)
    at, below = cache.create(), cache.create()
    d.append([at, below], [prompt(b_prime), prompt(b_prime - 1)])  # a prefill that ends on B' and one short of it
    assert (cache.physical_length(at), cache.physical_length(below)) == (budget, b_prime - 1)
    row = cache.create()
    d.append([row], [prompt(b_prime - 3)])
    step = StaticDecode(net, cache, graphs=False) if static else None
    lengths = []
    with torch.inference_mode():
        for _ in range(3 + buffer - 1 + 1):  # one token at a time
            if step is not None:
                step([row], [5])
            else:
                net.decode(torch.tensor([5]), cache, [row])
            lengths.append(cache.physical_length(row))
    # B' - 2, B' - 1, then the token that makes B' entries compresses to B; B + 1 .. B' - 1; B again
    assert lengths == [b_prime - 2, b_prime - 1, budget, *range(budget + 1, b_prime), budget]
    assert cache.peak_length(row) == b_prime and cache.length(row) == b_prime - 3 + len(lengths)
    # the rows the steps did not append to keep their lengths
    assert [(cache.physical_length(r), cache.length(r)) for r in (at, below)] == [(budget, b_prime), (b_prime - 1,) * 2]


@pytest.mark.parametrize("buffer", [128, 40])
@pytest.mark.parametrize("budget", [16, 24])
def test_physical_length_is_bounded(net, budget, buffer):
    cache = BoundedCache.for_model(net, budget=budget, buffer=buffer)
    trigger = budget + buffer
    d = Driver(net, cache)
    row = cache.create()
    appends = [30, 1, 150, 1, 1, 7, 64, 1, 130, 1]  # mixes prefill, decode and helper steps
    for i, n in enumerate(appends * 3):
        before = cache.physical_length(row)
        d.append([row], [prompt(n, seed=i)])
        after = cache.physical_length(row)
        if before + n >= trigger:
            assert after == budget
        else:
            assert after == before + n
        assert cache.peak_length(row) <= trigger - 1 + max(appends)
    assert cache.length(row) == 3 * sum(appends)


@pytest.mark.parametrize("policy", ["rkv", "snapkv", "streaming", "knorm", "keydiff", "random"])
def test_compression_keeps_what_the_policy_selects(net, policy):
    """What the cache keeps, against the oracles (rkv, snapkv, streaming) or the policy's own choice on the same entries
    (the query-free presses and the random draw, whose choices tests/engine/evictors/ check)."""
    budget = 16
    cache = BoundedCache.for_model(net, budget=budget, evictor=policy)
    seen = []  # (lengths, keys, values, windows before; keys, values after) of each compression
    compress = cache.compress

    def spy(rows):
        slots = [cache.slot(r) for r in rows]
        lengths = [cache.physical_length(r) for r in rows]
        before = cache.k[:, slots].clone(), cache.v[:, slots].clone(), cache.q[:, slots].clone()
        compress(rows)
        seen.append((lengths, *before, cache.k[:, slots, :, :budget].clone(), cache.v[:, slots, :, :budget].clone()))

    cache.compress = spy
    d = Driver(net, cache)
    root = cache.create()
    first = d.append([root], [prompt(100)])
    d.greedy([root], first, 40)  # 140 entries: the children compress with a partly inherited ring
    kids = cache.fork(root, 3)
    firsts = d.append(kids, [[11], [12], prompt(140, seed=3)])  # the third child passes B' at once
    d.greedy(kids, firsts, 140)
    assert len(seen) >= 4 and any(len(c[0]) == 2 for c in seen)  # two rows compressed together
    for lengths, k, v, q, k_after, v_after in seen:
        for i, length in enumerate(lengths):
            for layer in range(k.shape[0]):
                keys, window = k[layer, i, :, :length], q[layer, i]
                if policy == "rkv":
                    kept = rkv_keep(keys, window, budget)
                elif policy == "snapkv":
                    kept = snapkv_keep(keys, window, budget)
                elif policy == "streaming":
                    kept = streaming_keep(length, budget).expand(keys.shape[0], -1)
                else:
                    kept = keep_positions(policy, keys, window, budget)
                assert torch.equal(k_after[layer, i], gather_positions(keys, kept))
                assert torch.equal(v_after[layer, i], gather_positions(v[layer, i, :, :length], kept))


class H2OLoop:
    """H2O's bookkeeping written out per row, layer and KV head (float64 Python): each entry's key and the attention
    it received from every query since it entered (logits maxed over the KV head's query group before the softmax over
    the entries the query sees), fed each forward's new queries and keys; a row that reaches B' keeps its top B - 8
    past entries by received attention (ties: earlier first) and its last 8, in order; a fork copies a row."""

    def __init__(self, cache: BoundedCache) -> None:
        self.cache, self.rows = cache, {}
        self.layers, _, self.h_kv, _, self.d = cache.k.shape

    def create(self, row: int) -> None:
        self.rows[row] = [[[] for _ in range(self.h_kv)] for _ in range(self.layers)]

    def fork(self, parent: int, children: list[int]) -> None:
        for child in children:
            self.rows[child] = copy.deepcopy(self.rows[parent])

    def forward(self, layer: int, rows: list[int], new: list[int], q: torch.Tensor, k: torch.Tensor) -> None:
        group = q.shape[1] // self.h_kv
        for i, (row, n) in enumerate(zip(rows, new)):
            for h, entries in enumerate(self.rows[row][layer]):
                cached = len(entries)
                entries += [[k[i, h, t].tolist(), 0.0] for t in range(n)]
                for t in range(n):
                    seen = entries[: cached + t + 1]
                    logits = [max(sum(a * b for a, b in zip(q[i, h * group + g, t].tolist(), key)) / math.sqrt(self.d)
                                  for g in range(group)) for key, _ in seen]
                    top = max(logits)
                    exps = [math.exp(x - top) for x in logits]
                    for entry, e in zip(seen, exps):
                        entry[1] += e / sum(exps)

    def end(self, rows: list[int]) -> None:
        budget = self.cache.budget
        for row in rows:
            for heads in self.rows[row]:
                for h, entries in enumerate(heads):
                    if len(entries) >= self.cache.trigger:
                        past = len(entries) - 8
                        ranked = sorted(range(past), key=lambda j: (-entries[j][1], j))[: budget - 8]
                        heads[h] = [entries[j] for j in sorted(ranked) + list(range(past, len(entries)))]

    def check(self, rows: list[int]) -> None:
        for row in rows:
            slot = self.cache.slot(row)
            for layer, heads in enumerate(self.rows[row]):
                for h, entries in enumerate(heads):
                    n = self.cache.physical_length(row)
                    assert len(entries) == n
                    keys = torch.tensor([key for key, _ in entries])
                    torch.testing.assert_close(self.cache.k[layer, slot, h, :n], keys, rtol=0, atol=0)
                    torch.testing.assert_close(self.cache.received[layer, slot, h, :n].double(),
                                               torch.tensor([score for _, score in entries], dtype=torch.float64),
                                               rtol=1e-4, atol=1e-6)


def test_h2o_accumulates_and_keeps_as_its_loop_transcription_per_kv_head(net):
    cache = BoundedCache.for_model(net, budget=16, evictor="h2o", buffer=16, max_append=48)  # B' = 32
    loop = H2OLoop(cache)
    attend, end, compressed = cache.attend, cache.end, []

    def spy_attend(layer, q, k, v):
        loop.forward(layer, cache.fwd.rows.tolist(), cache.fwd.new_lengths.tolist(), q, k)
        return attend(layer, q, k, v)

    def spy_end():
        rows = cache.fwd.rows.tolist()
        compressed.extend(r for r in rows if cache.physical_length(r) >= cache.trigger)
        end()
        loop.end(rows)
        loop.check(rows)

    cache.attend, cache.end = spy_attend, spy_end
    d = Driver(net, cache)
    root = cache.create()
    loop.create(root)
    d.greedy([root], d.append([root], [prompt(20)]), 30)
    kids = cache.fork(root, 3)
    loop.fork(root, kids)
    firsts = d.append(kids, [[101], [102, 103], prompt(40, seed=2)])  # the third child passes B' at once
    d.greedy(kids, firsts, 20)
    cache.adopt(root, kids[1])
    loop.rows[root] = loop.rows.pop(kids[1])
    cache.release([kids[0], kids[2]])
    d.greedy([root], torch.tensor([7]), 20)
    assert len(compressed) >= 6 and kids[2] in compressed  # compressions of every row, forked ones included


def test_query_ring_holds_the_last_eight_queries(net):
    cache = BoundedCache.for_model(net, budget=16)
    history: dict[int, list[torch.Tensor]] = {}
    attend = cache.attend

    def spy(layer, q, k, v):
        for i, n in enumerate(cache.fwd.new_lengths.tolist()):
            history.setdefault(layer, []).append(q[i, :, :n])
        return attend(layer, q, k, v)

    cache.attend = spy
    d = Driver(net, cache)
    row = cache.create()
    for i, n in enumerate([5, 1, 1, 3, 20, 1, 6, 1, 1, 1, 150, 2]):
        d.append([row], [prompt(n, seed=i)])
        slot = cache.slot(row)
        for layer, qs in history.items():
            expected = torch.cat(qs, dim=1)[:, -8:]
            assert torch.equal(cache.q[layer, slot, :, -expected.shape[1]:], expected)


class Aranges(TorchDispatchMode):
    """How many `arange`s were dispatched."""

    def __init__(self) -> None:
        super().__init__()
        self.aranges = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.aranges += func.overloadpacket == torch.ops.aten.arange
        return func(*args, **(kwargs or {}))


def test_the_query_rings_new_place_is_worked_out_once_a_forward(net):
    """Where each row's query ring lies after a forward of several tokens a row (ragged) is worked out on the host,
    once: no layer dispatches an `arange` (each built the ring's index before); the rings hold the last eight
    queries (test above)."""
    cache = BoundedCache.for_model(net, budget=16)
    rows = [cache.create() for _ in range(2)]
    attend, aranges = cache.attend, []

    def counted(layer, q, k, v):
        with Aranges() as mode:
            out = attend(layer, q, k, v)
        aranges.append(mode.aranges)
        return out

    cache.attend = counted
    Driver(net, cache).append(rows, [prompt(5, seed=1), prompt(3, seed=2)])
    assert aranges == [0] * net.args.n_layers


def test_logical_positions_survive_compression(net):
    """Layer 0's post-RoPE keys depend only on the token and its position, so teacher-forcing the
    same tokens through an evicting and a full cache must give identical layer-0 keys and positions."""
    records = {}
    for name, cache in [("full", FullCache.for_model(net, 4096)), ("rkv", BoundedCache.for_model(net, budget=16))]:
        keys, positions = [], []
        attend, begin = cache.attend, cache.begin

        def spy_attend(layer, q, k, v, attend=attend, keys=keys):
            if layer == 0:
                keys.append(k.clone())
            return attend(layer, q, k, v)

        def spy_begin(rows, n_new, begin=begin, positions=positions):
            out = begin(rows, n_new)
            positions.append(out.clone())
            return out

        cache.attend, cache.begin = spy_attend, spy_begin
        d = Driver(net, cache)
        row = cache.create()
        for i, n in enumerate([40] + [1] * 150 + [60] + [1] * 10):
            d.append([row], [prompt(n, seed=i)])
        records[name] = keys, positions, cache.length(row)
    (k_full, p_full, n_full), (k_rkv, p_rkv, n_rkv) = records["full"], records["rkv"]
    assert n_full == n_rkv == 40 + 150 + 60 + 10
    assert all(torch.equal(a, b) for a, b in zip(p_full, p_rkv))
    for a, b in zip(k_full, k_rkv):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


@pytest.mark.parametrize("model", ["net", "one_layer_net"])
def test_a_fork_never_changes_its_parent(model, request):
    net = request.getfixturevalue(model)
    cache = BoundedCache.for_model(net, budget=16)
    d = Driver(net, cache)
    parent = cache.create()
    d.append([parent], [prompt(130)])
    slot = cache.slot(parent)
    snapshot = cache.k[:, slot, :, :130].clone(), cache.q[:, slot].clone()
    kids = cache.fork(parent, 2)
    for kid in kids:
        kid_slot = cache.slot(kid)
        assert cache.length(kid) == 130 and cache.physical_length(kid) == 130
        assert torch.equal(cache.k[:, kid_slot, :, :130], snapshot[0])
        assert torch.equal(cache.q[:, kid_slot], snapshot[1])
    d.append(kids, [prompt(20, seed=5), [3]])  # the first child compresses
    assert cache.physical_length(kids[0]) == 16 and cache.physical_length(kids[1]) == 131
    assert cache.physical_length(parent) == cache.length(parent) == 130
    assert torch.equal(cache.k[:, slot, :, :130], snapshot[0]) and torch.equal(cache.q[:, slot], snapshot[1])
    assert cache.peak_length(kids[0]) == 150 and cache.peak_length(parent) == 130


def test_bad_settings_are_refused(net):
    with pytest.raises(ValueError):
        BoundedCache.for_model(net, budget=8)
    with pytest.raises(ValueError):
        BoundedCache.for_model(net, budget=64, evictor="h3o")
    with pytest.raises(ValueError, match="unknown evictor 'none'"):  # `--evictor none` keeps a FullCache
        BoundedCache.for_model(net, budget=64, evictor="none")


def test_a_cache_made_in_inference_mode_forks_outside_it(net):
    with torch.inference_mode():
        cache = BoundedCache.for_model(net, budget=16, rows=1)
    Driver(net, cache).append([cache.create()], [prompt(10)])
    assert len(cache.fork(0, 3)) == 3 and cache.length(3) == 10


def test_adopt_and_release_free_slots_and_ids_for_reuse(net):
    cache = BoundedCache.for_model(net, budget=16, rows=4)
    root = cache.create()
    kids = cache.fork(root, 3)  # every slot in use
    old_slot, kid_slot = cache.slot(root), cache.slot(kids[0])
    cache.adopt(root, kids[0])
    assert cache.slot(root) == kid_slot
    again = cache.create()  # reuses the adopted child's id and the root's old slot, without growing
    assert (again, cache.slot(again), cache.k.shape[1]) == (kids[0], old_slot, 4)
    cache.release([kids[1]])
    assert cache.create() == kids[1] and cache.k.shape[1] == 4


def test_releases_add_to_the_free_slots_and_ids(net):
    cache = BoundedCache.for_model(net, budget=16, rows=4)
    a, b, c = (cache.create() for _ in range(3))  # slot 3 still free
    cache.release([a])
    cache.release([b])
    again = [cache.create() for _ in range(3)]  # b's slot and id, a's, then slot 3 and a new id: no growth
    assert sorted(again) == [a, b, c + 1] and cache.k.shape[1] == 4
    assert sorted(cache.slot(r) for r in [c, *again]) == [0, 1, 2, 3]


def test_the_scratch_slot_is_one_more_slot_no_row_gets(net):
    cache = BoundedCache.for_model(net, budget=16, rows=3)
    scratch = cache.reserve_slot()
    assert (scratch, cache.k.shape[1], cache.q.shape[1]) == (3, 4, 4)
    rows = [cache.create() for _ in range(3)]  # the rows it was sized for fit without a growth
    assert cache.k.shape[1] == 4 and scratch not in {cache.slot(r) for r in rows}


def test_pools_grow_when_an_append_does_not_fit(net):
    cache = BoundedCache.for_model(net, budget=16, max_append=8)  # room for 152 entries
    row = cache.create()
    Driver(net, cache).append([row], [prompt(152)])
    assert cache.capacity == 152  # an append that just fits grows nothing
    Driver(net, cache).append([row], [prompt(193)])  # 16 entries after the compression + 193
    assert cache.capacity == 256  # the pools grow to the append, rounded up to 64


def forward(cache: BoundedCache, rows: list[int], new: list[int], device: str = "cpu",
            dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, ...]:
    """One multi-token forward of layer 0 straight through the cache protocol, with random q, k, v
    [R, H, max(new), D] (right padded); returns them with the attention output."""
    gen = torch.Generator().manual_seed(0)
    _, _, h_kv, _, d = cache.k.shape
    q, k, v = (torch.randn(len(rows), h, max(new), d, generator=gen).to(device, dtype)
               for h in (cache.q.shape[2], h_kv, h_kv))
    cache.begin(rows, new)
    out = cache.attend(0, q, k, v)
    cache.end()
    return q, k, v, out


def test_a_multi_token_append_writes_each_row_s_new_entries_and_nothing_past_them():
    cache = BoundedCache(1, 4, 2, 8, budget=16)
    rows, new = [cache.create(), cache.create()], [3, 1]
    _, k, v, _ = forward(cache, rows, new)
    for i, (row, n) in enumerate(zip(rows, new)):
        held_k, held_v = cache.k[0, cache.slot(row)], cache.v[0, cache.slot(row)]
        assert torch.equal(held_k[:, :n], k[i, :, :n]) and torch.equal(held_v[:, :n], v[i, :, :n])
        assert not held_k[:, n:].any() and not held_v[:, n:].any()  # not the padding token's k/v


def test_for_model_takes_the_model_s_dtype_and_device_and_indexes_there(net):
    """The meta device stands in for a GPU: an index made on the CPU beside the pools is an error."""
    model = copy.deepcopy(net).to("meta", torch.bfloat16)
    cache = BoundedCache.for_model(model, budget=16)
    assert {(t.dtype, t.device.type) for t in (cache.k, cache.v, cache.q)} == {(torch.bfloat16, "meta")}
    out = forward(cache, [cache.create(), cache.create()], [3, 1], "meta", torch.bfloat16)[-1]
    assert (out.dtype, out.device.type, out.shape) == (torch.bfloat16, "meta", (2, 4, 3, 16))


def test_rows_beyond_the_pools_double_them():
    cache = BoundedCache(1, 4, 2, 8, budget=16, rows=3)
    rows = [cache.create() for _ in range(4)]
    assert (cache.k.shape[1], cache.v.shape[1], cache.q.shape[1]) == (6, 6, 6) and rows == [0, 1, 2, 3]


def test_rows_given_descending_slots_read_their_own_entries(net):
    """Released slots are reused last in, first out: a fork can get slots 2, 1, which are not the range 2..3."""
    def run(cache) -> tuple[list[list[int]], list[torch.Tensor]]:
        d = Driver(net, cache)
        root = cache.create()
        cache.release([cache.create(), cache.create()])
        d.append([root], [prompt(12)])
        kids = cache.fork(root, 2)
        if isinstance(cache, BoundedCache):
            assert [cache.slot(k) for k in kids] == [2, 1]
        return d.greedy(kids, d.append(kids, [[9], [8, 7]]), 4), d.logits

    full_toks, full_logits = run(FullCache.for_model(net, 4096))
    toks, logits = run(BoundedCache.for_model(net, budget=64))
    assert toks == full_toks
    for a, b in zip(logits, full_logits):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("bounded", [True, False])
def test_fork_each_equals_a_fork_of_each_row(net, bounded):
    """One batched fork of several parents (one of them twice) decodes as forks made one at a time."""
    def make():
        return BoundedCache.for_model(net, budget=16, rows=2) if bounded else FullCache.for_model(net, 4096, max_rows=32)

    lengths, picks = [5, 140, 12], [0, 2, 0, 1]
    results = []
    for batched in (True, False):
        cache = make()
        d = Driver(net, cache)
        parents = [cache.create() for _ in lengths]
        d.append(parents, [prompt(n, seed=n) for n in lengths])
        chosen = [parents[i] for i in picks]
        kids = cache.fork_each(chosen, 2) if batched else [k for p in chosen for k in cache.fork(p, 2)]
        assert [cache.length(k) for k in kids] == [lengths[i] for i in picks for _ in range(2)]
        d.greedy(kids, torch.arange(len(kids)) + 40, 20)  # the bounded rows of 140 reach B' = 144 and compress
        results.append(torch.cat(d.logits[1:]))
        cache.release(parents + kids)
        if not bounded:
            assert cache.blocks_in_use() == 0  # every reference the fork took is dropped again
    torch.testing.assert_close(results[0], results[1], rtol=0, atol=0)


def test_a_long_appended_row_is_compressed_within_the_plans_slices_of_its_similarity():
    """A row that reaches B' by a 5,000-token append (a long prompt, a long helper step) is compressed holding R-KV's
    similarity SIMILARITY_ROWS keys at a time: the measured peak is within the planner's figure and below one whole
    L x L similarity per layer and KV head (the old scoring's least)."""
    from kvrescue.engine_bytes import compress_bytes
    from kvrescue.model_config import ModelArgs
    from tests.tensor_bytes import TensorBytes

    layers, heads, kv_heads, dim, length = 2, 4, 2, 16, 5000
    cache = BoundedCache(layers, heads, kv_heads, dim, budget=64, max_append=length, rows=1)
    row = cache.create()
    torch.manual_seed(6)
    cache.begin([row], [length])
    for layer in range(layers):
        cache.attend(layer, torch.randn(1, heads, length, dim), torch.randn(1, kv_heads, length, dim),
                     torch.randn(1, kv_heads, length, dim))
    with TensorBytes() as measured:
        cache.end()
    assert cache.physical_length(row) == 64
    args = ModelArgs(vocab_size=8, dim=heads * dim, intermediate_size=8, n_layers=layers, n_heads=heads,
                     n_kv_heads=kv_heads, head_dim=dim)
    assert measured.peak <= compress_bytes(args, 4, 1, length) < 4 * layers * kv_heads * length * length


@pytest.mark.parametrize("units, cut", [(None, (3, 2, 2)), (8, (2, 2, 2)), (2, (1, 1, 2)), (1, (1, 1, 1))])
def test_rows_too_long_for_one_call_are_compressed_by_layers_then_kv_heads_keeping_what_one_call_keeps(
        monkeypatch, units, cut):
    """Rows whose scoring exceeds COMPRESS_BYTES (a 32k-token prompt on a 7B: 12 GiB per layer) are compressed in
    slices of `compress_slice`: fewer rows, then one row's layers, then one layer's KV heads at a time. Bounds of
    `units` (row, layer, KV head) similarities take each slicing at a small length; each keeps exactly the
    positions scoring every row, layer and KV head in one call keeps, and peaks within the planner's figure."""
    import kvrescue.shapes as shapes
    from kvrescue.engine_bytes import compress_bytes
    from kvrescue.model_config import ModelArgs
    from tests.tensor_bytes import TensorBytes

    layers, heads, kv_heads, dim, length, budget = 2, 4, 2, 16, 600, 64
    if units is not None:
        monkeypatch.setattr(shapes, "COMPRESS_BYTES", units * 3 * 4 * length * length)
    taken = shapes.compress_slice(layers, kv_heads, length)
    assert (min(taken.rows, 3), taken.layers, taken.kv_heads) == cut
    cache = BoundedCache(layers, heads, kv_heads, dim, budget=budget, max_append=length, rows=3)
    rows = [cache.create() for _ in range(3)]
    torch.manual_seed(7)
    keys, values = torch.randn(2, layers, 3, kv_heads, length, dim).unbind()
    window = torch.randn(layers, 3, heads, OBSERVATION_WINDOW, dim)
    for i, row in enumerate(rows):  # the pools as a 600-token append leaves them
        slot = cache.slot(row)
        cache.k[:, slot, :, :length], cache.v[:, slot, :, :length] = keys[:, i], values[:, i]
        cache.q[:, slot] = window[:, i]
        cache.row_physical[row] = length
    kept = keep_positions("rkv", keys, window, budget)  # every row, layer and KV head in one call
    with TensorBytes() as measured:
        cache.compress(rows)
    for i, row in enumerate(rows):
        slot = cache.slot(row)
        assert cache.physical_length(row) == budget
        torch.testing.assert_close(cache.k[:, slot, :, :budget], gather_positions(keys, kept)[:, i], rtol=0, atol=0)
        torch.testing.assert_close(cache.v[:, slot, :, :budget], gather_positions(values, kept)[:, i], rtol=0, atol=0)
    args = ModelArgs(vocab_size=8, dim=heads * dim, intermediate_size=8, n_layers=layers, n_heads=heads,
                     n_kv_heads=kv_heads, head_dim=dim)
    assert measured.peak <= compress_bytes(args, 4, 3, length)


def test_a_32k_prompt_on_a_7b_base_is_compressed_two_kv_heads_at_a_time():
    """At R1-Distill-Qwen-7B's shapes (Qwen2.5-Math-7B's: 28 layers, 4 KV heads) a 32,768-token append's
    compression is planned at two (layer, KV head) similarities at once, under 1 GiB; scoring the row whole
    held 112 of them, 36 GiB."""
    from kvrescue.engine_bytes import compress_bytes
    from kvrescue.model_config import ModelArgs
    from kvrescue_testkit.paper_shapes import QWEN25_MATH_7B as shape
    from kvrescue.shapes import compress_slice

    layers, kv_heads = shape["num_hidden_layers"], shape["num_key_value_heads"]
    assert tuple(vars(compress_slice(layers, kv_heads, 32768)).values()) == (1, 1, 2)
    args = ModelArgs(vocab_size=shape["vocab_size"], dim=shape["hidden_size"],
                     intermediate_size=shape["intermediate_size"], n_layers=layers,
                     n_heads=shape["num_attention_heads"], n_kv_heads=kv_heads, head_dim=128)
    assert compress_bytes(args, 2, 8, 32768) < 2**30


@pytest.mark.parametrize("allocating,uniform", [(PyramidKV(beta=1), SnapKV()), (AdaKV(safeguard=1.0), RKV()),
                                                (AdaKV(scores="snapkv", safeguard=1.0), SnapKV())], ids=str)
def test_a_uniform_allocation_decodes_and_keeps_bitwise_as_r_kv_and_snapkv(net, allocating, uniform):
    """PyramidKV with beta 1 and Ada-KV with a whole safeguard allocate B to every layer and KV head: through their
    path (per-head counts, hole masks, per-(layer, row, head) scoring) the same logits and entries, bit for bit."""
    runs = []
    for policy in (allocating, uniform):
        cache = BoundedCache.for_model(net, budget=16, evictor=policy)
        runs.append((cache, scenario(net, cache, decode=70)))
    (a, (toks_a, logits_a)), (b, (toks_b, logits_b)) = runs
    assert toks_a == toks_b and all(torch.equal(x, y) for x, y in zip(logits_a, logits_b))
    assert rows_in_use(a) == rows_in_use(b) and max(a.row_peak) == a.trigger  # compressed
    for row in rows_in_use(a):
        n = a.physical_length(row)
        assert n == b.physical_length(row) and (a.row_held[row] == a.row_base[row]).all()  # no hole
        for x, y in ((a.k, b.k), (a.v, b.v)):
            assert torch.equal(x[:, a.slot(row), :, :n], y[:, b.slot(row), :, :n])


def drive(cache: BoundedCache, steps: int, seed: int = 0) -> list[int]:
    """Three rows of random queries, keys and values: prompts of 30, 5 and 17 tokens, then one token at a time."""
    gen = torch.Generator().manual_seed(seed)
    n_layers, _, h_kv, _, d = cache.k.shape
    h = cache.q.shape[2]
    rows = [cache.create() for _ in range(3)]
    for t in range(steps):
        new = [30, 5, 17] if t == 0 else [1, 1, 1]
        cache.begin(rows, new)
        for layer in range(n_layers):
            q, k, v = (torch.randn(3, heads, max(new), d, generator=gen) for heads in (h, h_kv, h_kv))
            cache.attend(layer, q, k, v)
        cache.end()
    return rows


def held_positions(cache: BoundedCache, row: int, layer: int, head: int, held=None, base=None, length=None):
    """The physical positions a row's (layer, KV head) holds: those its last compression kept, then those since."""
    held = cache.row_held[row, layer, head] if held is None else held
    base = cache.row_base[row] if base is None else base
    return list(range(held)) + list(range(base, cache.physical_length(row) if length is None else length))


@pytest.mark.parametrize("policy", [PyramidKV(beta=2), AdaKV(), AdaKV(scores="snapkv", safeguard=0.0)], ids=str)
def test_an_allocating_compression_keeps_what_its_transcription_keeps_per_head(policy):
    """Each (layer, row, KV head) scored on the entries it holds alone; the layer's past positions kept as kvpress's
    pyramid budget (evictors/test_pyramidkv) or Ada-KV's transcription (tests/oracles.py) picks, the last
    OBSERVATION_WINDOW too; the kept entries moved to the front, in order, the counts recorded."""
    cache = BoundedCache(3, 4, 2, 8, budget=16, evictor=policy, rows=4)
    seen = []
    compress = cache.compress

    def spy(rows):
        state = [(cache.slot(r), cache.physical_length(r), cache.row_held[r].copy(), int(cache.row_base[r]))
                 for r in rows]
        before = cache.k.clone(), cache.q.clone()
        compress(rows)
        seen.append((rows, state, *before, cache.k.clone(), cache.row_held.copy()))

    cache.compress = spy
    drive(cache, 300)
    assert len(seen) >= 4
    group = 2
    for rows, state, k, q, k_after, held_after in seen:
        for row, (slot, length, held, base) in zip(rows, state):
            for layer, budget in enumerate(cache.layer_budgets):
                at = [held_positions(cache, row, layer, head, held[layer, head], base, length) for head in range(2)]
                scores = [policy.score(k[layer, slot, head, at[head]][None],
                                       q[layer, slot, head * group:(head + 1) * group])[0].tolist()
                          for head in range(2)]
                if isinstance(policy, AdaKV):
                    past = [s + [-math.inf] * (length - 8 - len(s)) for s in scores]
                    keep = adakv_keep_past(past, budget, cache.trigger - 8, policy.safeguard)
                else:
                    keep = [sorted(sorted(range(len(s)), key=lambda j: (-s[j], j))[: budget - 8]) for s in scores]
                for head in range(2):
                    kept = [at[head][j] for j in keep[head]] + at[head][-8:]
                    assert held_after[row, layer, head] == len(kept)
                    assert torch.equal(k_after[layer, slot, head, : len(kept)], k[layer, slot, head, kept])
    budgets = [cache.row_held[r].sum(axis=1) for r in rows_in_use(cache)]  # each layer's total over its heads
    assert all((b == [2 * x for x in cache.layer_budgets]).all() for b in budgets)
    assert any(len(set(cache.row_held[r].ravel().tolist())) > 1 for r in rows_in_use(cache))


@pytest.mark.parametrize("policy", [PyramidKV(beta=2), AdaKV()], ids=str)
def test_attention_reads_each_heads_held_entries_alone(policy):
    """After ragged compressions, a multi-token append attends per KV head over what that head holds (the holes
    between its kept entries and the row's base masked), and causally over the new tokens."""
    cache = BoundedCache(2, 4, 2, 8, budget=16, evictor=policy, rows=4)
    rows = drive(cache, 200)
    assert any(len(set(cache.row_held[r].ravel().tolist())) > 1 for r in rows)
    gen = torch.Generator().manual_seed(9)
    new = [3, 1, 2]
    lengths = [cache.physical_length(r) for r in rows]
    held = [cache.row_held[r].copy() for r in rows]
    bases = [int(cache.row_base[r]) for r in rows]
    cache.begin(rows, new)
    for layer in range(2):  # PyramidKV: the first layer the widest, without holes; the second with
        q, k, v = (torch.randn(3, heads, 3, 8, generator=gen) for heads in (4, 2, 2))
        out = cache.attend(layer, q, k, v)
        for i, row in enumerate(rows):
            for head in range(2):
                at = held_positions(cache, row, layer, head, held[i][layer, head], bases[i], lengths[i])
                keys, values = cache.k[layer, cache.slot(row), head, at], cache.v[layer, cache.slot(row), head, at]
                for t in range(new[i]):
                    ks, vs = torch.cat([keys, k[i, head, : t + 1]]), torch.cat([values, v[i, head, : t + 1]])
                    for g in range(2):
                        weights = (ks @ q[i, head * 2 + g, t] / math.sqrt(8)).softmax(-1)
                        torch.testing.assert_close(out[i, head * 2 + g, t], weights @ vs)
    cache.end()
