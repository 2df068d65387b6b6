"""FlexAttention's decode paths (engine/flex.py), run eagerly on the CPU (PyTorch's reference implementation of the
kernel that CUDA compiles, with the same block masks and mask functions): equal to SDPA over ragged lengths, blocks
shared by several rows, compressed pools with holes and the static step's padded rows; and reading the pools in place
(no gather of any row's keys), where the SDPA paths gather them."""

import os
import subprocess
import sys

import pytest
import torch
from torch.nn.attention.flex_attention import AuxOutput
from torch.utils._python_dispatch import TorchDispatchMode

import kvrescue.engine.flex as flex
from kvrescue.engine.attention import attend_masked
from kvrescue.engine.bounded import BoundedCache, hole_free
from kvrescue.engine.caches import FullCache
from kvrescue.engine.evictors.registry import make_evictor
from kvrescue.evictor_catalogue import parse_evictor
from kvrescue.engine.graphs import StaticDecode
from kvrescue.engine.loader import load_model

# The eager form is the point here: the reference implementation of the kernel CUDA compiles.
pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
HQ, HKV, D = 14, 2, 8  # 7 query heads a KV head, as Qwen2.5-7B has
GATHERS = {torch.ops.aten.index.Tensor, torch.ops.aten.index_select.default, torch.ops.aten.gather.default}


@pytest.fixture
def flex_on(monkeypatch):
    monkeypatch.setattr(flex, "SERVES", True)


class PoolGathers(TorchDispatchMode):
    """The most elements one indexing op (a gather: `index`, `index_select`, `gather`) read out of the K/V pools of
    `cache` into a new tensor, outside the attention kernel (FlexAttention's operation passes through as one), and
    the kernel's calls."""

    supports_higher_order_operators = True

    def __init__(self, cache) -> None:
        super().__init__()
        self.pools = {cache.k.untyped_storage().data_ptr(), cache.v.untyped_storage().data_ptr()}
        self.largest, self.flex_calls = 0, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if isinstance(func, torch._ops.HigherOrderOperator):
            self.flex_calls += func.name() == "flex_attention"
            with torch._C._DisableTorchDispatch():
                return func(*args, **(kwargs or {}))
        out = func(*args, **(kwargs or {}))
        if func in GATHERS and args[0].untyped_storage().data_ptr() in self.pools:
            self.largest = max(self.largest, out.numel())
        return out


def test_paged_attention_reads_each_rows_blocks_through_its_table(flex_on) -> None:
    """Rows sharing leading blocks (forks), ragged lengths (an empty row's one key to a row of six blocks), tables
    padded with the row's own last block or with other rows' blocks, rows padded to a power of two: output and
    log-sum-exp equal SDPA's over each row's keys gathered, with GQA."""
    generator = torch.Generator().manual_seed(0)
    bs, pool_blocks = 4, 24
    k_pool, v_pool = torch.randn(2, pool_blocks, bs, HKV, D, generator=generator)
    blocks = [[5, 9, 2], [5, 9, 11, 3, 7, 1], [5, 9], [8], [4, 6]]  # rows 0-2 share blocks 5 and 9
    cached = torch.tensor([10, 22, 7, 0, 4])  # keys 0 .. cached: the last is the step's own (5 rows: 3 padding)
    width = 7
    table = torch.tensor([b + [b[-1] if i % 2 else 11] * (width - len(b)) for i, b in enumerate(blocks)])
    q = torch.randn(len(blocks), HQ, 1, D, generator=generator)
    out, lse = flex.PagedSteps(table, cached, pool_blocks, bs).attend(q, k_pool, v_pool)
    for row, (ids, n) in enumerate(zip(blocks, (cached + 1).tolist())):
        keys, values = (pool[ids].flatten(0, 1)[:n].transpose(0, 1)[None] for pool in (k_pool, v_pool))
        want = torch.nn.functional.scaled_dot_product_attention(q[row: row + 1], keys, values, enable_gqa=True)
        scores = q[row] @ keys[0].repeat_interleave(HQ // HKV, 0).transpose(1, 2) * D**-0.5  # [Hq, 1, n]
        torch.testing.assert_close(out[row: row + 1], want, atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(lse[row, :, 0], scores[:, 0].logsumexp(-1), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("holes", [False, True])
def test_slot_attention_sees_each_slots_entries_and_not_its_holes(flex_on, holes) -> None:
    """A bounded cache's pools: each slot its own length (0 for slots outside the step), and with an allocating
    evictor's holes, per KV head, those masked (`bounded.hole_free`): equal to masked SDPA over the slots."""
    generator = torch.Generator().manual_seed(1)
    slots, capacity, span = 5, 48, 40
    k, v = torch.randn(2, slots, HKV, capacity, D, generator=generator)
    held = torch.tensor([39, 0, 17, 5, 24])
    keys, block = flex.span_tiles(span, capacity)
    assert (keys, block) == (48, 16)
    q = torch.randn(slots, HQ, 1, D, generator=generator)
    visible = (torch.arange(keys) <= held[:, None])[:, None, None]  # [slots, 1, 1, keys]
    mask_holes = None
    if holes:
        kept, base = torch.tensor([[20, 30], [0, 0], [9, 12], [3, 5], [10, 16]]), torch.tensor([30, 0, 12, 5, 16])
        visible = visible & hole_free(kept, base, keys)
        mask_holes = (kept, base)
    got = flex.attend_slots(q, k[:, :, :keys], v[:, :, :keys], flex.slots_mask(held, keys, block, HQ // HKV, mask_holes))
    torch.testing.assert_close(got, attend_masked(q, k[:, :, :keys], v[:, :, :keys], visible), atol=1e-6, rtol=1e-5)


def test_span_tiles_round_the_span_up_to_whole_tiles() -> None:
    assert [flex.span_tiles(span, 512) for span in (144, 128, 100, 40)] == [(144, 16), (128, 128), (112, 16),
                                                                           (48, 16)]
    assert flex.span_tiles(100, 110) is None  # 112 keys do not fit slots of 110: SDPA serves


def test_flex_serves_on_cuda_with_triton_and_never_with_batch_invariance(monkeypatch) -> None:
    from kvrescue.engine import invariance

    assert not flex.serves(torch.zeros(1))  # a CPU: SDPA
    monkeypatch.setattr(flex, "SERVES", True)
    assert flex.serves(torch.zeros(1))
    monkeypatch.setattr(invariance, "on", lambda: True)
    assert not flex.serves(torch.zeros(1))


def test_the_kernel_is_checked_once_against_sdpa_and_sdpa_serves_where_it_fails(monkeypatch, capsys) -> None:
    """`runs_on` (the first use on a CUDA device): a kernel that runs and agrees serves; one that raises (a compiler
    that cannot build it) or disagrees does not, and says so in one line on stderr."""
    check = flex.runs_on.__wrapped__  # uncached
    assert check(torch.device("cpu"), torch.float32) and capsys.readouterr().err == ""

    def broken(*args, **kwargs):
        raise RuntimeError("no ptxas")

    monkeypatch.setattr(flex, "_attend", broken)
    assert not check(torch.device("cpu"), torch.float32)
    assert capsys.readouterr().err == ("kvrescue: FlexAttention does not run on cpu (RuntimeError: no ptxas); "
                                       "SDPA serves\n")
    monkeypatch.setattr(flex, "_attend", lambda q, *args, lse=False: (torch.zeros_like(q), AuxOutput(lse=q[..., 0])))
    assert not check(torch.device("cpu"), torch.float32)
    assert capsys.readouterr().err == "kvrescue: FlexAttention disagrees with SDPA on cpu in torch.float32; SDPA serves\n"


def test_forwards_of_several_tokens_are_checked_on_their_own(monkeypatch, capsys) -> None:
    """`runs_on(..., several=True)` checks forwards of several tokens a row (FlexAttention's decoding kernel and, from
    QUERY_BLOCK folded queries, its main one) apart from the one-token steps: a main kernel that cannot be built
    keeps them on SDPA, the one-token steps on FlexAttention."""
    check = flex.runs_on.__wrapped__
    assert check(torch.device("cpu"), torch.float32, several=True) and capsys.readouterr().err == ""
    attend = flex._attend

    def no_main_kernel(q, *args, **kwargs):
        if q.shape[2] >= flex.QUERY_BLOCK:
            raise RuntimeError("Q and KV block size must be divisible by BLOCK_M and BLOCK_N")
        return attend(q, *args, **kwargs)

    monkeypatch.setattr(flex, "_attend", no_main_kernel)
    assert check(torch.device("cpu"), torch.float32)
    assert not check(torch.device("cpu"), torch.float32, several=True)
    assert "FlexAttention does not run on cpu (RuntimeError: Q and KV block size" in capsys.readouterr().err


def _flex_calls(monkeypatch) -> list[int]:
    """A list that grows by one at each FlexAttention call."""
    calls, attend = [], flex._attend
    monkeypatch.setattr(flex, "_attend", lambda *args, **kw: calls.append(1) or attend(*args, **kw))
    return calls


def _decode_steps(net, cache, steps: int, generator, graphs: bool) -> list[torch.Tensor]:
    """Logits of `steps` one-token steps of three rows (a prompt each, then a fork of the first into two and the
    last released), through the static step or `net.decode`."""
    step = StaticDecode(net, cache, graphs=True) if graphs else None  # its scratch slot or block first
    lengths = [5, 20, 33]
    prompt = torch.randint(0, net.args.vocab_size, (3, max(lengths)), generator=generator)
    rows = [cache.create() for _ in lengths]
    net.prefill(prompt, cache, rows, lengths)
    logits = []
    for t in range(steps):
        if t == steps // 3:
            children = cache.fork(rows[0], 2)
            cache.release([rows.pop()])
            rows += children
        tokens = torch.randint(0, net.args.vocab_size, (len(rows),), generator=generator)
        with torch.inference_mode():
            logits.append(step(rows, tokens) if graphs else net.decode(tokens, cache, rows))
    return logits


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "static"])
@pytest.mark.parametrize("evictor", ["rkv", "adakv:scores=snapkv"])
def test_the_bounded_caches_decode_through_flex_equals_sdpa(qwen2_dir, evictor, graphs, monkeypatch) -> None:
    """The eager one-token forward and the static step, through compressions (B' = 24: every few steps), forks and
    releases, holes with an allocating evictor, and the static step's padding rows (3 and 4 rows in a bucket of 4):
    the same logits and greedy tokens as the eager SDPA step."""
    net = load_model(qwen2_dir).net
    policy = make_evictor(*parse_evictor(evictor))
    calls = _flex_calls(monkeypatch)
    logits = {}
    for on in (False, True):
        monkeypatch.setattr(flex, "SERVES", on)
        cache = BoundedCache.for_model(net, budget=16, buffer=8, evictor=policy, max_append=40, rows=4)
        logits[on] = _decode_steps(net, cache, 30, torch.Generator().manual_seed(2), graphs=graphs and on)
        assert any(cache.row_held.ravel() != cache.row_held.max()) if policy.allocates else True  # holes
    assert len(calls) == 30 * net.args.n_layers
    for got, want in zip(logits[True], logits[False]):
        torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)
        assert (got.argmax(-1) == want.argmax(-1)).all()


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "static"])
def test_the_full_caches_decode_through_flex_equals_sdpa(qwen2_dir, graphs, monkeypatch) -> None:
    """The full cache's eager decode and its static step (row and block buckets, a scratch block for padding rows),
    through forks sharing blocks and the copy of a shared partly filled block: the logits and greedy tokens of the
    eager SDPA decode."""
    net = load_model(qwen2_dir).net
    calls = _flex_calls(monkeypatch)
    logits = {}
    for on in (False, True):
        monkeypatch.setattr(flex, "SERVES", on)
        cache = FullCache.for_model(net, 1024, max_rows=8, max_row_tokens=128, block_size=16)
        logits[on] = _decode_steps(net, cache, 12, torch.Generator().manual_seed(3), graphs=graphs and on)
    assert len(calls) == 12 * net.args.n_layers
    for got, want in zip(logits[True], logits[False]):
        torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)
        assert (got.argmax(-1) == want.argmax(-1)).all()


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "static"])
@pytest.mark.parametrize("kind", ["bounded", "full"])
def test_decode_steps_read_the_pools_in_place(qwen2_dir, kind, graphs, monkeypatch) -> None:
    """A one-token step's attention through FlexAttention gathers nothing out of the K/V pools; through SDPA it
    gathers every row's keys (the paths the flex one replaces: rows in slots apart, in pools of more than
    IN_PLACE_SLOTS slots a row of the bucket)."""
    from torch.nn.attention import flex_attention

    # The kernel's operation called as it is (eager FlexAttention otherwise traces it, which no dispatch mode allows).
    monkeypatch.setattr(flex_attention, "_FLEX_ATTENTION_DISABLE_COMPILE_DEBUG", True)
    net = load_model(qwen2_dir).net
    largest = {}
    for on in (False, True):
        monkeypatch.setattr(flex, "SERVES", on)
        if kind == "bounded":
            cache = BoundedCache.for_model(net, budget=16, buffer=40, max_append=40, rows=16)  # > IN_PLACE_SLOTS x 4
            span = cache.trigger if graphs else 34  # the static step's span; the rows' entries
        else:
            cache = FullCache.for_model(net, 1024, max_rows=8, max_row_tokens=128, block_size=16)
            span = 48  # the rows' blocks
        step = StaticDecode(net, cache, graphs=True) if graphs else None
        prompt = torch.randint(0, net.args.vocab_size, (3, 33), generator=torch.Generator().manual_seed(4))
        rows = [cache.create() for _ in range(4)]
        cache.release([rows.pop(1)])  # rows in slots or blocks apart
        net.prefill(prompt, cache, rows, [33] * 3)
        tokens = torch.zeros(3, dtype=torch.long)
        with PoolGathers(cache) as counter, torch.inference_mode():
            step(rows, tokens) if graphs else net.decode(tokens, cache, rows)
        largest[on] = counter.largest
        assert counter.flex_calls == (net.args.n_layers if on else 0)
    spans = 3 * net.args.n_kv_heads * span * net.args.head_dim  # three rows' keys of one layer
    assert largest[False] >= spans and largest[True] == 0


@pytest.mark.parametrize(("value", "serves"), [("0", False), ("1", True), ("", None)])
def test_kvrescue_flex_in_the_environment_sets_the_choice(value, serves) -> None:
    """KVRESCUE_FLEX=0 keeps FlexAttention off (1 on) in a process that imports the engine, as a run's workers do."""
    env = {**os.environ, "KVRESCUE_FLEX": value}
    done = subprocess.run([sys.executable, "-c", "import kvrescue.engine.flex as f; print(f.SERVES)"], env=env,
                          capture_output=True, text=True, check=True, timeout=120)
    assert done.stdout.strip() == str(serves)


def _paged_rows(generator, tokens: int):
    """Rows of a paged pool for forwards of several tokens: forks sharing blocks (rows 0-2), last blocks partly
    filled, ragged cached lengths and new-token counts (row 3 caches nothing), tables padded with a row's own last
    block or another row's; pools [24 blocks, 4, Hkv, D]."""
    bs, pool_blocks = 4, 24
    k_pool, v_pool = torch.randn(2, pool_blocks, bs, HKV, D, generator=generator)
    blocks = [[5, 9, 2, 13], [5, 9, 11, 3, 7, 1, 14], [5, 9, 15], [8, 16], [4, 6, 10]]
    cached = torch.tensor([10, 22, 7, 0, 4])
    new = torch.tensor([tokens, 3, tokens - 1, tokens, 1])
    table = torch.tensor([b + [b[-1] if i % 2 else 12] * (8 - len(b)) for i, b in enumerate(blocks)])
    return k_pool, v_pool, blocks, table, cached, new, bs, pool_blocks


def test_paged_mask_of_several_tokens_shows_each_query_its_cached_keys_and_its_own_causally(flex_on) -> None:
    """The block mask of a forward of T new tokens a row (folded: 7 query heads x T' = 32 padded tokens, one query
    tile of 256), read as the kernel reads it (the blocks listed for the row, then the mask function): query t of row
    s sees exactly the pool positions of its keys 0 .. cached[s] + t (a direct transcription), whatever its head;
    padding tokens and padding rows see key 0 at least."""
    k_pool, _, blocks, table, cached, new, bs, pool_blocks = _paged_rows(torch.Generator().manual_seed(5), 6)
    group, tokens = 7, 32
    mask = flex.paged_mask(table, cached, pool_blocks, bs, group, tokens, new)
    assert mask.BLOCK_SIZE == (256, bs) and mask.kv_num_blocks.shape == (8, 1, 1)  # rows padded to 8, one tile
    positions = torch.arange(pool_blocks * bs)
    for row in range(8):
        listed = torch.isin(positions // bs, mask.kv_indices[row, 0, 0, : mask.kv_num_blocks[row, 0, 0]])
        for query in range(group * tokens):
            seen = listed & mask.mask_mod(torch.tensor(row), torch.tensor(0), torch.tensor(query), positions)
            t = query % tokens
            if row < len(blocks) and t < new[row]:
                keys = range(int(cached[row]) + t + 1)
                want = {blocks[row][j // bs] * bs + j % bs for j in keys}
                assert set(positions[seen].tolist()) == want, (row, query)
            else:
                assert seen[table[row, 0] * bs if row < len(blocks) else 0]


def test_paged_attention_of_several_tokens_equals_causal_sdpa_over_each_rows_keys(flex_on) -> None:
    """`PagedSteps` of T = 5 new tokens a row (padded to 8): output and log-sum-exp of each valid token equal SDPA's
    over its row's keys gathered (cached, then the new ones causally), with GQA."""
    generator = torch.Generator().manual_seed(6)
    k_pool, v_pool, blocks, table, cached, new, bs, pool_blocks = _paged_rows(generator, 5)
    q = torch.randn(len(blocks), HQ, 5, D, generator=generator)
    out, lse = flex.PagedSteps(table, cached, pool_blocks, bs, 5, new).attend(q, k_pool, v_pool)
    assert out.shape == q.shape and lse.shape == q.shape[:3]
    for row, ids in enumerate(blocks):
        n, c = int(new[row]), int(cached[row])
        keys, values = (pool[ids].flatten(0, 1)[: c + n].transpose(0, 1)[None] for pool in (k_pool, v_pool))
        visible = torch.arange(c + n)[None, :] <= c + torch.arange(n)[:, None]
        queries = q[row: row + 1, :, :n]
        want = torch.nn.functional.scaled_dot_product_attention(queries, keys, values, visible, enable_gqa=True)
        scores = queries[0] @ keys[0].repeat_interleave(HQ // HKV, 0).transpose(1, 2) * D**-0.5  # [Hq, n, c + n]
        torch.testing.assert_close(out[row: row + 1, :, :n], want, atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(lse[row, :, :n], scores.masked_fill(~visible, float("-inf")).logsumexp(-1),
                                   atol=1e-5, rtol=1e-5)


def _appends(net, cache, generator) -> list[torch.Tensor]:
    """The logits of each valid new token of a full cache's forwards of several tokens a row over cached keys: three
    rows' prompts (a first prefill), appends to them (ragged lengths and counts, last blocks partly filled), appends to
    forks of two of them (sharing blocks, a partly filled one copied) beside their parent, and a committed step fed
    with forks made from the room reserved for it (a PRM's scoring: the forks copy a block filled in that forward)."""
    def forward(rows, counts):
        tokens = torch.randint(0, net.args.vocab_size, (len(rows), max(counts)), generator=generator)
        with torch.inference_mode():
            logits = net.prefill(tokens, cache, rows, counts, last_only=False)
        return logits[torch.arange(max(counts))[None, :] < torch.tensor(counts)[:, None]]

    rows = [cache.create() for _ in range(3)]
    logits = [forward(rows, [5, 20, 33]), forward(rows, [7, 3, 12])]
    forks = cache.fork(rows[0], 2) + cache.fork(rows[2], 1)
    logits.append(forward(forks + [rows[1]], [4, 9, 6, 5]))
    cache.reserve([rows[2]], [5])
    scored = cache.fork(rows[2], 2)
    logits.append(forward([rows[2]] + scored, [5, 8, 3]))
    return logits


@pytest.mark.parametrize("cascade", ["paged", "cascade"])
def test_full_cache_forwards_of_several_tokens_through_flex_equal_sdpa(qwen2_dir, cascade, monkeypatch) -> None:
    """Appends, forks' appends and a PRM-style scoring forward over cached keys (`_appends`), paged and cascading
    (whose rows' own blocks then go through FlexAttention, merged by its log-sum-exp with the shared pass): every
    forward over cached keys through FlexAttention, the logits of every valid token and the greedy tokens of the SDPA
    path."""
    from kvrescue.engine import caches
    from kvrescue.shapes import ALWAYS_CASCADE

    net = load_model(qwen2_dir).net
    calls, merges, merge = _flex_calls(monkeypatch), [], caches.merge_partials
    monkeypatch.setattr(caches, "merge_partials", lambda *parts: merges.append(1) or merge(*parts))
    logits = {}
    for on in (False, True):
        monkeypatch.setattr(flex, "SERVES", on)
        cache = FullCache.for_model(net, 1024, max_rows=8, max_row_tokens=128, block_size=16,
                                    cascade=ALWAYS_CASCADE if cascade == "cascade" else None)
        logits[on] = _appends(net, cache, torch.Generator().manual_seed(7))
    assert len(calls) == 3 * net.args.n_layers  # the first prefill attends over its new keys alone
    assert bool(merges) == (cascade == "cascade")  # the scoring forward's rows share two blocks: cascaded
    for got, want in zip(logits[True], logits[False]):
        torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)
        assert (got.argmax(-1) == want.argmax(-1)).all()


def test_the_prm_scores_through_flex_as_through_sdpa(prm_dir, monkeypatch) -> None:
    """A PRM scoring candidates as suffixes of cached prefixes, then committed steps fed with the next candidates:
    the candidates' forwards through FlexAttention, the scores of the SDPA path."""
    from kvrescue.engine.prm import PRMScorer

    prm = load_model(prm_dir)
    calls = _flex_calls(monkeypatch)
    scores = {}
    for on in (False, True):
        monkeypatch.setattr(flex, "SERVES", on)
        scorer = PRMScorer(prm, max_problems=2, max_candidates=8)
        for key, problem in enumerate(["What is 3x + 5 = 20 for x?", "Compute 1 + 2 + 3 + ... + 10."]):
            scorer.open(key, problem)
        texts = ["Step 1: 3x = 15.\n\n", "x = 7.\n\n", "We compute the sum.\n\n"]
        scores[on] = scorer.score([(key, text, []) for key in range(2) for text in texts])
        for key in range(2):
            scorer.commit(key, texts[key])
        scores[on] += scorer.score([(key, text, []) for key in range(2) for text in texts[1:]])
    assert calls
    assert scores[True] == pytest.approx(scores[False], abs=2e-5)


def test_forwards_of_several_tokens_read_the_pools_in_place(qwen2_dir, monkeypatch) -> None:
    """A full cache's forward of several tokens a row over cached keys through FlexAttention gathers nothing out of
    the K/V pools; through SDPA it gathers every row's blocks (whole rows padded to the longest)."""
    from torch.nn.attention import flex_attention

    monkeypatch.setattr(flex_attention, "_FLEX_ATTENTION_DISABLE_COMPILE_DEBUG", True)
    net = load_model(qwen2_dir).net
    largest = {}
    for on in (False, True):
        monkeypatch.setattr(flex, "SERVES", on)
        cache = FullCache.for_model(net, 1024, max_rows=8, max_row_tokens=128, block_size=16, cascade=None)
        prompt = torch.randint(0, net.args.vocab_size, (3, 33), generator=torch.Generator().manual_seed(8))
        rows = [cache.create() for _ in range(4)]
        cache.release([rows.pop(1)])  # rows in blocks apart
        net.prefill(prompt, cache, rows, [33] * 3)
        with PoolGathers(cache) as counter, torch.inference_mode():
            net.prefill(prompt[:, :6], cache, rows, [6, 4, 5])
        largest[on] = counter.largest
        assert counter.flex_calls == (net.args.n_layers if on else 0)
    assert largest[False] >= 3 * net.args.n_kv_heads * 48 * net.args.head_dim and largest[True] == 0


def test_forwards_of_new_shapes_past_the_budget_take_sdpa(flex_on, monkeypatch) -> None:
    """The compiled kernel is specialised to each shape: forwards of several tokens a row take FlexAttention in the
    first FORWARD_SHAPES shapes (rows and tokens bucketed, pools) of the process, SDPA in later ones; one-token steps
    always."""
    from kvrescue.engine.attention import reader

    monkeypatch.setattr(flex, "_forward_shapes", set())
    monkeypatch.setattr(flex, "FORWARD_SHAPES", 2)
    pool = torch.zeros(8, 16, HKV, D)
    assert [reader(pool, tokens, True, rows) for tokens, rows in ((32, 5), (20, 8), (3, 8))] == ["flex"] * 3
    assert reader(pool, 64, True, 8) == reader(torch.zeros(9, 16, HKV, D), 32, True, 8) == "torch"  # a third shape
    assert reader(pool, 4, True, 7) == "flex" and reader(pool, 1, True, 100) == "flex"
    assert reader(pool, 4, False, 7) == "torch"  # not causal: the cascade's shared pass


def test_paged_steps_take_a_static_forwards_padded_rows_and_token_counts(flex_on) -> None:
    """As a static (CUDA-graph) forward would call it: a block table padded with rows of a scratch block (0 cached, 0
    new tokens), every row's queries padded to a fixed 8 tokens, per-row new-token counts as a tensor: the real rows'
    valid tokens as without the padding, every output finite."""
    generator = torch.Generator().manual_seed(9)
    k_pool, v_pool, blocks, table, cached, new, bs, pool_blocks = _paged_rows(generator, 5)
    q = torch.randn(len(blocks), HQ, 5, D, generator=generator)
    want, want_lse = flex.PagedSteps(table, cached, pool_blocks, bs, 5, new).attend(q, k_pool, v_pool)
    scratch = pool_blocks - 1
    padded_table = torch.cat([table, torch.full((3, table.shape[1]), scratch)])
    padded_cached, padded_new = (torch.cat([counts, torch.zeros(3, dtype=torch.long)]) for counts in (cached, new))
    padded_q = torch.nn.functional.pad(torch.cat([q, torch.randn(3, HQ, 5, D, generator=generator)]), (0, 0, 0, 3))
    got, lse = flex.PagedSteps(padded_table, padded_cached, pool_blocks, bs, 8, padded_new).attend(padded_q, k_pool,
                                                                                                   v_pool)
    assert got.isfinite().all() and lse.isfinite().all()
    for row in range(len(blocks)):
        n = int(new[row])
        torch.testing.assert_close(got[row, :, :n], want[row, :, :n], atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(lse[row, :, :n], want_lse[row, :, :n], atol=1e-6, rtol=1e-5)
