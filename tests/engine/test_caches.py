"""FullCache: shared-prefix decoding equals private copies; forks, adopt and memory accounting."""

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from kvrescue.engine import FullCache, load_model
from kvrescue.engine.attention import attend_padded
from kvrescue.engine.paged_forward import shared_prefixes
from kvrescue.shapes import ALWAYS_CASCADE

pytestmark = pytest.mark.usefixtures("kernel_layouts")  # each test also under CUDA's kernel layouts

TOL = 1e-4


@pytest.fixture(scope="module")
def model(qwen2_dir):
    return load_model(qwen2_dir)


def _prefill(model, cache, row, tokens):
    return model.net.prefill(torch.tensor([tokens]), cache, [row], [len(tokens)])[0]


def _decode(model, cache, rows, tokens):
    return model.net.decode(torch.tensor(tokens), cache, rows)


@torch.no_grad()
def test_shared_prefix_equals_private_copies(model) -> None:
    g = torch.Generator().manual_seed(0)
    prefix = torch.randint(0, 400, (23,), generator=g).tolist()  # ends inside a block: exercises copy-on-write
    n, steps = 4, 7
    suffixes = torch.randint(0, 400, (n, steps), generator=g)

    shared = FullCache.for_model(model.net, 4096, max_rows=16, block_size=8)
    parent = shared.create()
    _prefill(model, shared, parent, prefix)
    children = shared.fork(parent, n)
    shared_logits = [_decode(model, shared, children, suffixes[:, t].tolist()) for t in range(steps)]

    private = FullCache.for_model(model.net, 4096, max_rows=16, block_size=8)
    rows = [private.create() for _ in range(n)]
    for r in rows:
        _prefill(model, private, r, prefix)
    private_logits = [_decode(model, private, rows, suffixes[:, t].tolist()) for t in range(steps)]

    for a, b in zip(shared_logits, private_logits):
        assert (a - b).abs().max() < TOL
    # Memory: the prefix is stored once; each child owns only its copied partial block plus new blocks.
    assert shared.blocks_in_use() == 3 + n * 2  # 23 tokens -> 3 blocks; 23+7=30 -> child blocks 2 (copy) and 3
    assert private.blocks_in_use() == n * 4


@torch.no_grad()
def test_fork_never_changes_parent_and_parent_never_changes_fork(model) -> None:
    cache = FullCache.for_model(model.net, 1024, max_rows=8, block_size=4)
    parent = cache.create()
    prefix = list(range(10, 20))
    _prefill(model, cache, parent, prefix)
    k_before = cache.k[:, cache.blocks(parent)].clone()
    (child,) = cache.fork(parent, 1)
    _decode(model, cache, [child], [5])
    _decode(model, cache, [child], [6])
    assert torch.equal(cache.k[:, cache.blocks(parent)], k_before)
    assert cache.length(parent) == 10 and cache.length(child) == 12
    # The parent moving on does not disturb the child either.
    next_parent = _decode(model, cache, [parent], [7])
    next_child = _decode(model, cache, [child], [8])
    ref = FullCache.for_model(model.net, 1024, max_rows=8, block_size=4)
    r = ref.create()
    _prefill(model, ref, r, prefix + [5, 6])
    assert (next_child - _decode(model, ref, [r], [8])).abs().max() < TOL
    r2 = ref.create()
    _prefill(model, ref, r2, prefix)
    assert (next_parent - _decode(model, ref, [r2], [7])).abs().max() < TOL


@torch.no_grad()
def test_adopt_commits_the_fork_and_frees_the_rest(model) -> None:
    cache = FullCache.for_model(model.net, 1024, max_rows=8, block_size=4)
    parent = cache.create()
    _prefill(model, cache, parent, list(range(30, 39)))
    children = cache.fork(parent, 3)
    for t in range(5):
        _decode(model, cache, children, [40 + t, 50 + t, 60 + t])
    cache.adopt(parent, children[1])
    cache.release([children[0], children[2]])
    assert cache.length(parent) == 14
    assert cache.blocks_in_use() == 4  # 14 tokens in blocks of 4; nothing else is referenced
    after = _decode(model, cache, [parent], [7])
    ref = FullCache.for_model(model.net, 1024, max_rows=8, block_size=4)
    r = ref.create()
    expected = _prefill(model, ref, r, list(range(30, 39)) + [50 + t for t in range(5)] + [7])
    assert (after - expected).abs().max() < TOL
    cache.release([parent])
    assert cache.blocks_in_use() == 0 and len(cache.free_rows) == 8


@torch.no_grad()
def test_memory_does_not_scale_with_candidates_times_context(model) -> None:
    cache = FullCache.for_model(model.net, 64 * 1024, max_rows=80, block_size=16)
    parent = cache.create()
    _prefill(model, cache, parent, [3] * 1000)  # 63 blocks (last one partial)
    children = cache.fork(parent, 64)
    for t in range(20):
        _decode(model, cache, children, [t + 1] * 64)
    # 1000 + 20 tokens: each child copies the partial block 62 and owns block 63; the rest is shared.
    assert cache.blocks_in_use() == 63 + 64 * 2
    assert cache.blocks_in_use() < 64 * 63 / 10


def test_out_of_blocks_is_a_clear_error(model) -> None:
    cache = FullCache.for_model(model.net, 32, max_rows=4, block_size=16)
    row = cache.create()
    with pytest.raises(RuntimeError, match="out of blocks"):
        _prefill(model, cache, row, [1] * 40)


def test_attend_padded_equals_per_row_attention() -> None:
    """Rows with different cached and new lengths, GQA, padded: same as each row attended alone."""
    g = torch.Generator().manual_seed(3)
    R, Hq, Hkv, D, T, L = 3, 4, 2, 8, 3, 12
    kv_lengths, new_lengths = torch.tensor([5, 0, 9]), torch.tensor([3, 2, 1])
    q = torch.randn(R, Hq, T, D, generator=g)
    k, v = torch.randn(R, Hkv, L, D, generator=g), torch.randn(R, Hkv, L, D, generator=g)
    out = attend_padded(q, k, v, kv_lengths, new_lengths)
    for r in range(R):
        c, n = int(kv_lengths[r]), int(new_lengths[r])
        kr = k[r, :, : c + n].repeat_interleave(Hq // Hkv, 0)
        vr = v[r, :, : c + n].repeat_interleave(Hq // Hkv, 0)
        s = q[r, :, :n] @ kr.transpose(-1, -2) / D**0.5
        s = s.masked_fill(torch.arange(c + n)[None, :] > c + torch.arange(n)[:, None], float("-inf"))
        assert (out[r, :, :n] - s.softmax(-1) @ vr).abs().max() < 1e-5


def test_shared_prefixes_are_the_rows_common_leading_blocks() -> None:
    """The cascade's groups (read from the host block table) against the rows' own block lists."""
    cache = FullCache(1, 1, 4, 512, max_rows=64, block_size=4)

    def grow(rows, n):
        cache.begin(rows, [n] * len(rows))
        cache.end()

    a, b, short = cache.create(), cache.create(), cache.create()
    grow([a, b, short], 10)  # two full blocks each, and a partly filled third
    grow([short], 1)
    kids_a = cache.fork(a, 3)
    grow(kids_a[:2], 7)      # copy-on-write of the partial block, then new blocks
    grandkids = cache.fork(kids_a[0], 2)
    grow(grandkids, 5)
    kids_b = cache.fork(b, 2)
    lonely = cache.create()
    grow([lonely], 3)        # under one block: in no group
    def reference(rows):
        lengths = [cache.length(r) for r in rows]
        by_first: dict[int, list[int]] = {}
        for i, row in enumerate(rows):
            if lengths[i] >= cache.block_size:
                by_first.setdefault(cache.blocks(row)[0], []).append(i)
        groups = []
        for members in by_first.values():
            if len(members) > 1:
                full = min(lengths[i] for i in members) // cache.block_size
                lists = [cache.blocks(rows[i])[:full] for i in members]
                groups.append((members, next((k for k in range(full) if len({bl[k] for bl in lists}) > 1), full)))
        return groups, lengths

    cases = {  # rows -> (members per group, shared blocks per group)
        (kids_a[2], lonely, *grandkids, b, *kids_a[:2], a, *kids_b, short): ([6, 3], [2, 2]),
        (*kids_a[:2], *grandkids): ([4], [2]),  # the two children part at their third block
        (kids_a[0], *grandkids): ([3], [4]),    # the grandchildren hold their parent's four full blocks
    }
    for rows, (sizes, shared) in cases.items():
        expected, lengths = reference(list(rows))
        groups = shared_prefixes(cache.block_table, np.array(rows), np.array(lengths))
        got = [(m.tolist(), int(s)) for m, s in zip(np.split(groups.rows, np.cumsum(groups.sizes)[:-1]), groups.shared)]
        assert got == expected
        assert [len(m) for m, _ in got] == sizes and [s for _, s in got] == shared


@torch.no_grad()
def test_copy_on_write_leaves_the_last_holder_its_block(model) -> None:
    """Children writing into their released parent's partly filled block: all but the last copy it."""
    cache = FullCache.for_model(model.net, 1024, max_rows=8, block_size=4)
    parent = cache.create()
    prefix = list(range(10, 20))  # blocks 0 and 1 full, block 2 partly filled
    _prefill(model, cache, parent, prefix)
    children = cache.fork(parent, 3)
    partial = cache.blocks(parent)[2]
    cache.release([parent])
    out = _decode(model, cache, children, [5, 6, 7])
    assert [cache.blocks(c)[2] == partial for c in children] == [False, False, True]
    assert cache.blocks_in_use() == 2 + 3
    for child, token, logits in zip(children, [5, 6, 7], out):
        ref = FullCache.for_model(model.net, 1024, max_rows=8, block_size=4)
        assert (logits - _prefill(model, ref, ref.create(), prefix + [token])).abs().max() < TOL


@pytest.mark.parametrize("cascade", [None, ALWAYS_CASCADE], ids=["paged", "cascade"])
def test_forks_of_reserved_room_append_in_the_forward_that_fills_it(qwen2_dir, cascade) -> None:
    """Two rows (one holding 11 tokens, one new) reserve room for their next tokens, three forks of each are made,
    and one forward appends the rows' tokens and the forks' own: the same outputs and K/V as feeding the rows first
    and then appending to forks of them (each fork's copy of the partly filled block made in every layer once the
    rows' tokens are stored there)."""
    net = load_model(qwen2_dir).net
    generator = torch.Generator().manual_seed(6)
    caches = [FullCache.for_model(net, 1024, max_rows=16, block_size=4, cascade=cascade) for _ in range(2)]
    prompt = torch.randint(0, net.args.vocab_size, (1, 11), generator=generator)
    fed = [torch.randint(0, net.args.vocab_size, (n,), generator=generator).tolist() for n in (6, 9)]
    suffixes = [torch.randint(0, net.args.vocab_size, (n,), generator=generator).tolist() for n in (5, 2, 9, 7, 3, 4)]
    outputs, keys = [], []
    for reserved, cache in zip((False, True), caches):
        rows = [cache.create(), cache.create()]
        net.prefill(prompt, cache, rows[:1], [11])
        if reserved:
            cache.reserve(rows, [6, 9])
        else:
            net.prefill(padded(fed), cache, rows, [6, 9])
        forks = cache.fork_each(rows, 3)
        appended = (rows + forks, fed + suffixes) if reserved else (forks, suffixes)
        out = net.prefill(padded(appended[1]), cache, appended[0], [len(t) for t in appended[1]], last_only=False)
        outputs.append([o[: len(t)] for o, t in zip(out[-6:], suffixes)])
        keys.append([cache.k[:, cache.blocks(r)].flatten(1, 2)[:, : cache.length(r)] for r in rows + forks])
    for got, want in zip(outputs[1] + keys[1], outputs[0] + keys[0]):
        torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)


def padded(token_lists: list[list[int]]) -> torch.Tensor:
    """Token lists right padded with 0 to the longest: [R, T]."""
    out = torch.zeros(len(token_lists), max(map(len, token_lists)), dtype=torch.long)
    for i, tokens in enumerate(token_lists):
        out[i, : len(tokens)] = torch.tensor(tokens)
    return out


class PoolReads(TorchDispatchMode):
    """The aten ops dispatched, how many of them read a cache's K/V pools into a new tensor (a gather), and the
    `select`s."""

    def __init__(self, cache) -> None:
        super().__init__()
        self.pools = {cache.k.untyped_storage().data_ptr(), cache.v.untyped_storage().data_ptr()}
        self.ops, self.gathers, self.selects = 0, 0, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        self.selects += func == torch.ops.aten.select.int
        if func in (torch.ops.aten.index_select.default, torch.ops.aten.index.Tensor) \
                and args[0].untyped_storage().data_ptr() in self.pools:
            self.gathers += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("rows_padding", [0.0, float("inf")])
def test_a_first_prefill_attends_over_its_new_keys_without_reading_the_pools(rows_padding) -> None:
    """A forward whose rows hold no keys yet (ragged prompts) attends causally over its new keys: every layer
    after the first dispatches the store and one SDPA (the mask laid out once, by the first layer), reading
    nothing back out of the pools, and equals `attend_padded` over the new keys, GQA 3."""
    g = torch.Generator().manual_seed(3)
    cache = FullCache(2, 2, 8, 64, max_rows=4, block_size=4, rows_padding=rows_padding)
    rows, n_new = [cache.create() for _ in range(3)], [9, 4, 13]
    q, k, v = torch.randn(3, 6, 13, 8, generator=g), *torch.randn(2, 3, 2, 13, 8, generator=g)
    cache.begin(rows, n_new)
    cache.attend(0, q, k, v)
    with PoolReads(cache) as reads:
        out = cache.attend(1, q, k, v)
    cache.end()
    want = attend_padded(q, k, v, torch.zeros(3, dtype=torch.long), torch.tensor(n_new))
    valid = torch.arange(13)[None, :] < torch.tensor(n_new)[:, None]
    assert (out - want).transpose(1, 2)[valid].abs().max() < TOL
    assert reads.gathers == 0 and reads.ops <= 21  # 17 (21 in CUDA's kernel layouts); the paged path took 32 or 72


def test_a_first_prefill_neither_lays_out_nor_uploads_a_paged_read(monkeypatch) -> None:
    """A forward whose rows hold no keys yet has no paged layout of its rows (it would not read it): none computed,
    none sent to the device; a forward over cached keys has one."""
    from kvrescue.engine import caches

    uploaded = []

    def upload_all(arrays, device, upload_all=caches.upload_all):
        uploaded.append(set(arrays))
        return upload_all(arrays, device)

    monkeypatch.setattr(caches, "upload_all", upload_all)
    cache = FullCache(2, 2, 8, 64, max_rows=4, block_size=4)
    rows = [cache.create() for _ in range(2)]
    cache.begin(rows, [9, 4])
    assert cache.fwd.own is None and not any(name.startswith("own.") for name in uploaded[-1])
    cache.end()
    cache.begin(rows, [2, 2])
    assert cache.fwd.own is not None and "own.table" in uploaded[-1]
    cache.end()


class Transposes(TorchDispatchMode):
    """How many `transpose`s were dispatched."""

    def __init__(self) -> None:
        super().__init__()
        self.transposes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.transposes += func.overloadpacket == torch.ops.aten.transpose
        return func(*args, **(kwargs or {}))


def test_a_one_token_store_writes_its_keys_without_a_transpose() -> None:
    """One new token a row (a decode step, dynamic or static) is stored as it lies, [R, Hkv, D]: no transpose of
    its k or v; each lands in its slot, in the pools made again by `reserve_block` (the layers' views too)."""
    g = torch.Generator().manual_seed(6)
    cache = FullCache(2, 2, 8, 64, max_rows=4, block_size=4)
    cache.reserve_block()
    k, v = torch.randn(2, 3, 2, 1, 8, generator=g)
    slots = torch.tensor([5, 17, 30])
    with Transposes() as counted:
        cache.store_at(1, slots, k, v)
    assert counted.transposes == 0
    for pool, new in ((cache.k, k), (cache.v, v)):
        assert torch.equal(pool[1].flatten(0, 1)[slots], new[:, :, 0])


def test_a_layer_reads_its_pools_through_the_views_made_with_them() -> None:
    """A forward's layer (rows holding keys, with a fork's copy of a block filled in the same forward) selects no
    pool: the store, the copies and the paged attention read the views of its K and V pools that the cache made when
    it allocated them (`caches.layer_views`; it selected each once a layer, and before that twice)."""
    g = torch.Generator().manual_seed(4)
    cache = FullCache(2, 2, 8, 64, max_rows=4, block_size=4)
    parent = cache.create()
    cache.begin([parent], [6])
    for layer in range(2):
        cache.attend(layer, *torch.randn(3, 1, 2, 6, 8, generator=g))
    cache.end()
    cache.reserve([parent], [1])
    child = cache.fork(parent, 1)[0]
    cache.begin([parent, child], [1, 2])
    with PoolReads(cache) as reads:
        cache.attend(0, torch.randn(2, 2, 2, 8, generator=g), *torch.randn(2, 2, 2, 2, 8, generator=g))
    cache.end()
    assert reads.selects == 0
