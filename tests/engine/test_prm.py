"""PRM scoring: incremental (cached prefix + suffix) equals from scratch and transformers' Qwen2Model + head, in
both recipes; each recipe builds exactly the token ids the README says."""

import pytest
import torch
from safetensors.torch import load_file
from tokenizers import Regex, pre_tokenizers
from transformers import Qwen2Model

from kvrescue.engine import load_model
from kvrescue.engine.graphs import StaticDecode
from kvrescue.engine.prm import SYSTEM_PROMPT, PRMScorer
from kvrescue.engine.prm_recipes import FORMATS
from kvrescue_testkit.random_checkpoints import build_tokenizer
from tests.dispatched import Dispatched
from tests.helpers import blind_prm
from tests.oracles import prm_last_scores, prm_scores

pytestmark = pytest.mark.usefixtures("kernel_layouts")  # each test also under CUDA's kernel layouts

PROBLEMS = ["What is 3x + 5 = 20 for x?", "Compute 1 + 2 + 3 + ... + 10."]
STEPS = [
    ["Step 1: 3x = 15.\n\n", "Step 2: Dividing both sides by 3 gives x = 5.\n\n", "The answer is \\boxed{5}.<|im_end|>"],
    ["We compute the sum.\n\n", "1 + 2 + 3 + ... + 10 = 55.\n\n", "Therefore, the final answer is $55$."],
]


@pytest.fixture(scope="module")
def prm(prm_dir):
    return load_model(prm_dir)


def recipe_ids(tok, recipe: str, problem: str, steps: list[str]) -> tuple[list[int], list[int]]:
    """The README's recipes written out: (token ids, the position of each step's score).

    model-card: the chat template's text with assistant content "<extra_0>".join(steps) + "<extra_0>", each step
    cut at <|im_end|> and without its "\\n\\n", tokenised whole, up to the last <extra_0>; the scores at the <extra_0>
    tokens.
    paper: the chat prompt (system, user, the assistant turn opened) + "\\n\\n", then each step's text ending in one
    "\\n\\n", each of these pieces tokenised on its own; the scores at each piece's last token."""
    clean = [s.split("<|im_end|>")[0].split("\n\n")[0] for s in steps]
    chat = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": problem}]
    if recipe == "model-card":
        text = tok.apply_chat_template(chat + [{"role": "assistant", "content": "<extra_0>".join(clean) + "<extra_0>"}],
                                       tokenize=False)
        ids = tok.encode(text, add_special_tokens=False)
        ends = [i for i, t in enumerate(ids) if t == tok.convert_tokens_to_ids("<extra_0>")]
        return ids[: ends[-1] + 1], ends  # what follows the last <extra_0> (<|im_end|>) changes no score
    pieces = [tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True) + "\n\n"]
    pieces += [c + "\n\n" for c in clean]
    ids, ends = [], []
    for piece in pieces:
        ids += tok.encode(piece, add_special_tokens=False)
        ends.append(len(ids) - 1)
    return ids, ends[1:]


def _reference(prm_dir, problem: str, steps: list[str], recipe: str) -> list[float]:
    """transformers' Qwen2Model + the score head read from the checkpoint, on the recipe's input."""
    body = Qwen2Model.from_pretrained(prm_dir, dtype=torch.float32).eval()
    sd = load_file(prm_dir / "model.safetensors")
    ids, ends = recipe_ids(load_model(prm_dir).tokenizer, recipe, problem, steps)
    with torch.no_grad():
        h = body(torch.tensor([ids])).last_hidden_state[0]
        h = torch.relu(h @ sd["score.0.weight"].T + sd["score.0.bias"]) @ sd["score.2.weight"].T + sd["score.2.bias"]
    return torch.softmax(h, -1)[ends, 1].tolist()


@pytest.mark.parametrize("recipe", ["paper", "model-card"])
def test_each_recipe_builds_exactly_its_token_ids(prm, recipe) -> None:
    tok = prm.tokenizer
    scorer = PRMScorer(prm, max_problems=2, max_candidates=8, recipe=FORMATS[recipe])
    scorer.open(0, PROBLEMS[0], [])
    sent = []
    append = scorer.inputs.candidates
    scorer.inputs.candidates = lambda requests: sent.append(append(requests)) or sent[-1]
    for t, step in enumerate(STEPS[0]):
        scorer.score([(0, step, []), (0, "A wrong turn: x = 7.\n\n", [])])
        for candidate, suffix in zip([step, "A wrong turn: x = 7.\n\n"], sent[-1]):
            ids, _ = recipe_ids(tok, recipe, PROBLEMS[0], STEPS[0][:t] + [candidate])
            assert scorer.inputs.problems[0].prefix() + suffix == ids
        scorer.commit(0, step, [])
    if recipe == "paper":  # written out once: no doubled separator, the <|im_end|> cut, one "\n\n" at the end
        assert tok.decode(scorer.inputs.problems[0].prefix()) == ("<|im_start|>system\n" + SYSTEM_PROMPT + "<|im_end|>\n<|im_start|>user\n" + PROBLEMS[0]
                                   + "<|im_end|>\n<|im_start|>assistant\n\n\nStep 1: 3x = 15.\n\nStep 2: Dividing both "
                                   "sides by 3 gives x = 5.\n\nThe answer is \\boxed{5}.\n\n")
    assert scorer.close(0)[1] == 0


# Qwen2's pre-tokenizer (its tokenizer.json): a run of newlines is one piece, cut before what follows.
QWEN_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|"
              r"\s+(?!\S)|\s+")


def test_on_qwen_s_pre_tokenizer_the_paper_pieces_tokenise_as_the_whole_text() -> None:
    tok = build_tokenizer()
    tok.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN_SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    paper = FORMATS["paper"]
    for problem, steps in zip(PROBLEMS, STEPS):
        steps = steps + [" Then $x = 5$.\n\n", "(a) 12 + 3 = 15.\n\n"]
        whole = tok.encode(paper.text(tok, problem, steps, SYSTEM_PROMPT), add_special_tokens=False)
        assert recipe_ids(tok, "paper", problem, steps)[0] == whole


@pytest.mark.parametrize("recipe", ["paper", "model-card"])
def test_incremental_equals_from_scratch_and_transformers(prm, prm_dir, recipe) -> None:
    scorer = PRMScorer(prm, max_problems=4, max_candidates=16, recipe=FORMATS[recipe])
    for key, problem in enumerate(PROBLEMS):
        scorer.open(key, problem, [])
    for t in range(3):
        # Both problems' candidates in one batch: the true next step and a distractor.
        requests = [(k, text, []) for k in (0, 1) for text in (STEPS[k][t], "A wrong turn: x = 7.\n\n")]
        got = scorer.score(requests)
        for (k, text, _), score in zip(requests, got):
            scratch = prm_scores(prm, PROBLEMS[k], STEPS[k][:t] + [text], recipe=FORMATS[recipe])[-1]
            assert abs(score - scratch) < 1e-4
            if text == STEPS[k][t]:
                assert abs(score - _reference(prm_dir, PROBLEMS[k], STEPS[k][: t + 1], recipe)[-1]) < 1e-4
        for k in (0, 1):
            scorer.commit(k, STEPS[k][t], [])
    for k in (0, 1):
        ref = _reference(prm_dir, PROBLEMS[k], STEPS[k], recipe)
        mine = prm_scores(prm, PROBLEMS[k], STEPS[k], recipe=FORMATS[recipe])
        assert len(mine) == len(ref) == 3 and max(abs(a - b) for a, b in zip(mine, ref)) < 1e-4
        processed, truncations = scorer.close(k)
        assert truncations == 0 and processed > 0
    assert scorer.cache.blocks_in_use() == 0


def test_window_drops_oldest_steps_and_records_it(prm) -> None:
    scorer = PRMScorer(prm, max_problems=2, max_candidates=4, window=120)
    scorer.open(0, PROBLEMS[0], [])
    prompt_len = len(scorer.inputs.problems[0].prompt)
    for text in STEPS[0] * 3:
        scorer.commit(0, text, [])
        assert len(scorer.inputs.problems[0].prefix()) <= 120
    (score,) = scorer.score([(0, STEPS[0][1], [])])
    kept = scorer.inputs.problems[0].kept_from  # the oldest committed steps cut to fit the window
    assert kept > 0
    committed = (STEPS[0] * 3)[kept:]
    assert abs(score - prm_scores(prm, PROBLEMS[0], committed + [STEPS[0][1]])[-1]) < 1e-4
    assert prompt_len <= scorer.cache.length(scorer.rows[0]) == len(scorer.inputs.problems[0].prefix()) <= 120
    _, truncations = scorer.close(0)
    assert truncations > 0


def test_model_without_prm_head_is_refused(qwen2_dir) -> None:
    with pytest.raises(ValueError, match="no process-reward head"):
        PRMScorer(load_model(qwen2_dir))


def test_candidates_beyond_the_cache_room_are_scored_in_chunks(prm) -> None:
    texts = [f"Step {i}: we compute {i} + {i} = {2 * i}.\n\n" for i in range(12)]
    roomy = PRMScorer(prm, max_problems=1, max_candidates=12, window=200)
    tight = PRMScorer(prm, max_problems=1, max_candidates=12, window=200, candidate_tokens=64)
    for scorer in (roomy, tight):
        scorer.open(0, PROBLEMS[1], [])
        scorer.commit(0, STEPS[1][0], [])
    a = roomy.score([(0, t, []) for t in texts])
    b = tight.score([(0, t, []) for t in texts])
    assert tight.cache.num_blocks - tight.cache.blocks_in_use() < 12 * 2  # too few blocks for all at once
    assert max(abs(x - y) for x, y in zip(a, b)) < 1e-5
    # the roomy scorer keeps the winner's row; the tight one, whose candidates went in several forwards, feeds it
    for scorer in (roomy, tight):
        scorer.commit(0, texts[3], [])
    assert (0 in roomy.held, tight.inputs.problems[0].unfed) == (False, tight.inputs.step_ids([texts[3]], 1)[0])
    a, b = (scorer.score([(0, t, []) for t in texts[:2]]) for scorer in (roomy, tight))
    assert a == pytest.approx(b, abs=1e-5)
    assert a[0] == pytest.approx(prm_scores(prm, PROBLEMS[1], [STEPS[1][0], texts[3], texts[0]])[-1], abs=1e-4)


def test_batched_from_scratch_scores_equal_one_trajectory_at_a_time(prm) -> None:
    trajectories = [STEPS[0][:1], STEPS[0], STEPS[1][:2], ["x\n\n"]]  # different lengths: padded rows
    want = [prm_scores(prm, PROBLEMS[0], steps)[-1] for steps in trajectories]
    assert prm_last_scores(prm, PROBLEMS[0], trajectories) == pytest.approx(want, abs=1e-5)
    assert len(set(want)) == len(want)  # the rows are told apart


def test_opens_are_fed_in_a_forward_and_a_scored_step_commits_without_one(prm, monkeypatch) -> None:
    """Prompts are fed in a forward of their own (the candidates would be padded to them); a committed step that was
    one of its problem's candidates keeps that candidate's row (no forward, not counted again), one that was not is
    fed with the next candidates, in their forward; the scores are the from-scratch ones."""
    forwards = []
    prefill = prm.net.prefill

    def counted(tokens, cache, rows, n_new, last_only=True):
        forwards.append(len(rows))
        return prefill(tokens, cache, rows, n_new, last_only)

    monkeypatch.setattr(prm.net, "prefill", counted)
    scorer = PRMScorer(prm, max_problems=4, max_candidates=8)
    for key in range(3):
        scorer.open(key, PROBLEMS[key % 2], [])
    assert forwards == []
    requests = [(key, text, []) for key in range(3) for text in (STEPS[key % 2][0], "x = 7.\n\n")]
    first = scorer.score(requests)
    assert forwards == [3, 6]  # the three prompts, then the six candidates
    unscored = "So y = 2.\n\n"
    committed = {0: STEPS[0][0], 1: unscored, 2: STEPS[0][0]}
    for key, text in committed.items():
        scorer.commit(key, text, [])
    scorer.close(2)
    assert forwards == [3, 6] and scorer.cache.blocks_in_use() == sum(
        len(scorer.cache.blocks(scorer.rows[key])) for key in (0, 1))  # the other candidates' rows are released
    requests = [(key, STEPS[key][1], []) for key in range(2)]
    second = scorer.score(requests)
    assert forwards == [3, 6, 3]  # problem 1's committed step with the candidates forked from it, in one forward
    assert first[0] == pytest.approx(prm_scores(prm, PROBLEMS[0], STEPS[0][:1])[-1], abs=1e-4)
    for (key, text, _), score in zip(requests, second):
        assert score == pytest.approx(prm_scores(prm, PROBLEMS[key], [committed[key], text])[-1], abs=1e-4)

    def ids(text):
        return scorer.inputs.step_ids([text])[0]

    # each problem: its prompt, two candidates, then one; problem 1's committed step is fed on its own
    for key in (0, 1):
        processed = len(scorer.inputs.problems[key].prompt) + sum(
            len(ids(text)) for text in (STEPS[key][0], "x = 7.\n\n", STEPS[key][1]))
        assert scorer.close(key)[0] == processed + (len(ids(unscored)) if key == 1 else 0)
    assert scorer.cache.blocks_in_use() == 0


def test_where_flash_attn_serves_the_prm_it_reads_its_cache_through_the_paged_kernel(prm, monkeypatch,
                                                                                     kernel_layouts) -> None:
    """On a device where flash-attn serves the PRM's tensors, its cache takes flash-attn's block size (the paged
    kernel takes no other) and every forward reads it through flash_attn_with_kvcache (a plain-torch stand-in
    here), the candidates' copied partial blocks too, with the from-scratch scores."""
    from kvrescue.engine import attention, caches
    from tests.engine.test_attention import reference_flash_attn_with_kvcache

    calls = []
    flash = kernel_layouts.flash(reference_flash_attn_with_kvcache)
    monkeypatch.setattr(attention, "flash_attn_with_kvcache", lambda *a, **kw: calls.append(kw["causal"])
                        or flash(*a, **kw))
    for module in (attention, caches):
        monkeypatch.setattr(module, "use_flash", lambda x: True)
    scorer = PRMScorer(prm, max_problems=2, max_candidates=4)
    assert scorer.cache.block_size == attention.FLASH_BLOCK
    scorer.open(0, PROBLEMS[0], [])
    scorer.commit(0, STEPS[0][0], [])
    texts = [STEPS[0][1], "A wrong turn: x = 7.\n\n"]
    got = scorer.score([(0, text, []) for text in texts])
    assert calls and all(calls)  # every forward, prefix and candidates, on the paged kernel
    assert got == pytest.approx(prm_last_scores(prm, PROBLEMS[0], [[STEPS[0][0], t] for t in texts]), abs=1e-4)
    scorer.close(0)
    assert scorer.cache.blocks_in_use() == 0


@pytest.mark.parametrize("recipe", ["paper", "model-card"])
def test_a_candidate_cut_to_the_window_with_no_step_left_to_drop_is_a_truncation(prm, recipe) -> None:
    ids = PRMScorer(prm, recipe=FORMATS[recipe]).inputs
    prompt = len(ids.open(0, PROBLEMS[0]).prompt)
    short, long = STEPS[0][0], "Step 2: Dividing both sides by 3 gives x = 5, and 3 * 5 + 5 = 20.\n\n"
    window = prompt + len(ids.step_ids([short])[0])  # the short candidate just fits, the long one does not
    scorer = PRMScorer(prm, max_problems=1, max_candidates=2, window=window, recipe=FORMATS[recipe])
    scorer.open(0, PROBLEMS[0], [])
    scorer.score([(0, short, [])])
    assert scorer.close(0) == (window, 0)
    scorer.open(0, PROBLEMS[0], [])
    scorer.score([(0, long, [])])  # nothing to drop: the candidate keeps its last window - prompt tokens
    assert scorer.inputs.problems[0].kept_from == 0
    assert scorer.close(0) == (window, 1)


@pytest.mark.parametrize("recipe", ["paper", "model-card"])
def test_a_candidate_cut_to_the_window_keeps_its_tail_ending_where_the_score_is_read(prm, recipe) -> None:
    inputs = PRMScorer(prm, recipe=FORMATS[recipe]).inputs
    prompt = len(inputs.open(0, PROBLEMS[0]).prompt)
    long = "Step 2: Dividing both sides by 3 gives x = 5, and 3 * 5 + 5 = 20.\n\n"
    (whole,) = inputs.step_ids([long])
    keep = len(whole) // 2
    cutting = type(inputs)(prm.tokenizer, FORMATS[recipe], window=prompt + keep)
    cutting.open(0, PROBLEMS[0])
    (cut,) = cutting.candidates([(0, long, [])])
    assert cut == whole[-keep:] and cut[-1] == whole[-1] and cut != whole[:keep]


def test_a_candidate_the_prm_sees_no_token_of_is_unscored_and_the_others_unchanged(prm_dir, tmp_path) -> None:
    blind = load_model(blind_prm(prm_dir, tmp_path / "prm", keep="Step 1: 3x = 15."))  # no newline, no "w"
    requests = [(0, "\n\nwww", []), (0, "Step 1: 3x = 15.\n\n", []), (0, "www\n\n", [])]
    scorer = PRMScorer(blind, max_problems=1, max_candidates=4)
    scorer.open(0, PROBLEMS[0])
    scores = scorer.score(requests)
    alone = PRMScorer(blind, max_problems=1, max_candidates=4)
    alone.open(0, PROBLEMS[0])
    assert scores[0] is None and scores[2] is None and scores[1] == alone.score(requests[1:2])[0]


def _static(scorer: PRMScorer) -> PRMScorer:
    """The scorer with its forwards in static shapes, as on CUDA with graphs on (here eagerly)."""
    scorer.static = StaticDecode(scorer.prm.net, scorer.cache)  # before any row holds a block
    return scorer


@pytest.mark.parametrize("score_bytes", [None, 40_000], ids=["one forward", "several"])
def test_static_scoring_equals_the_eager_scoring_in_several_buckets(prm, monkeypatch, score_bytes) -> None:
    """Three problems over three steps, 2, 1 and 3 candidates each of different lengths (row buckets 8, 4 and 16 with
    padding rows; token buckets with padding tokens), forked from prefixes whose last block is partly filled: the
    static forwards (what CUDA graphs replay on a GPU) give the eager scores, and so does a committed step that was
    none of its problem's candidates, fed in a static forward of its own; only the prompts are fed eagerly. Where
    SDPA's mask of all rows would pass SCORE_BYTES, the rows go in several forwards of fewer."""
    from kvrescue.engine import graphs

    if score_bytes:
        monkeypatch.setattr(graphs, "SCORE_BYTES", score_bytes)
    scorers = {"eager": PRMScorer(prm, max_problems=4, max_candidates=16),
               "static": _static(PRMScorer(prm, max_problems=4, max_candidates=16))}
    static = scorers["static"]
    eager_forwards = []
    prefill = prm.net.prefill

    def counted(tokens, cache, rows, n_new, last_only=True):
        eager_forwards.append(cache is static.cache)
        return prefill(tokens, cache, rows, n_new, last_only)

    monkeypatch.setattr(prm.net, "prefill", counted)
    distractors = ["x = 7.\n\n", "A wrong turn: we divide both sides by 4 and get x = 5/4, so x = 1.25.\n\n", "7\n\n"]
    for scorer in scorers.values():
        for key in range(3):
            scorer.open(key, PROBLEMS[key % 2], [])
    for t, wrong in enumerate((1, 0, 2)):
        requests = [(key, text, []) for key in range(3)
                    for text in [STEPS[key % 2][t]] + distractors[:wrong] + distractors[2:] * (t == 2)]
        got = {name: scorer.score(requests) for name, scorer in scorers.items()}
        assert got["static"] == pytest.approx(got["eager"], abs=2e-5)
        assert any(static.cache.length(static.rows[key]) % static.cache.block_size for key in range(3))
        for scorer in scorers.values():
            for key in range(3):  # problem 2's second step was none of its candidates: fed in a forward of its own
                scorer.commit(key, "So y = 2.\n\n" if (key, t) == (2, 1) else STEPS[key % 2][t], [])
    assert eager_forwards.count(True) == 1  # the prompts
    keys = set(static.static.steps)
    assert len({tokens for _, _, tokens in keys}) >= 2
    if score_bytes:
        assert max(rows for rows, _, _ in keys) <= 4
    else:
        assert {rows for rows, _, _ in keys} >= {4, 8, 16}
    for key in range(3):
        assert static.close(key) == scorers["eager"].close(key)
    assert static.cache.blocks_in_use() == 1  # the scratch block


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_where_flexattention_serves_the_static_scoring_reads_the_blocks_in_place(prm, monkeypatch) -> None:
    """Where FlexAttention serves (on CUDA with Triton; eagerly here), the static forwards of several tokens a row
    read the pools through its block mask, each row's new-token count from the static buffer: the eager SDPA scores."""
    from kvrescue.engine import flex

    eager = PRMScorer(prm, max_problems=2, max_candidates=8)
    static = _static(PRMScorer(prm, max_problems=2, max_candidates=8))
    tokens_read = []
    attend = flex.PagedSteps.attend

    def spy(self, q, k_pool, v_pool):
        tokens_read.append(q.shape[2])
        return attend(self, q, k_pool, v_pool)

    monkeypatch.setattr(flex.PagedSteps, "attend", spy)
    for scorer in (eager, static):
        for key in range(2):
            scorer.open(key, PROBLEMS[key], [])
    for t in range(2):
        requests = [(key, text, []) for key in range(2) for text in (STEPS[key][t], "x = 7.\n\n")]
        want = eager.score(requests)
        monkeypatch.setattr(flex, "SERVES", True)
        got = static.score(requests)
        monkeypatch.setattr(flex, "SERVES", False)
        assert got == pytest.approx(want, abs=2e-5)
        for scorer in (eager, static):
            for key in range(2):
                scorer.commit(key, STEPS[key][t], [])
    assert tokens_read and min(tokens_read) > 1  # every static forward read through FlexAttention


def test_where_flash_attn_serves_the_static_scoring_it_reads_the_whole_table_in_place(prm, monkeypatch,
                                                                                      kernel_layouts) -> None:
    """With flash-attn the static forwards read each row's whole block table (and the columns its padding tokens
    reach past it) through the paged kernel (a plain-torch stand-in here): the from-scratch scores."""
    from kvrescue.engine import attention, caches, graphs
    from tests.engine.test_attention import reference_flash_attn_with_kvcache

    monkeypatch.setattr(attention, "flash_attn_with_kvcache", kernel_layouts.flash(reference_flash_attn_with_kvcache))
    for module in (attention, caches, graphs):
        monkeypatch.setattr(module, "use_flash", lambda x: True)
    scorer = _static(PRMScorer(prm, max_problems=2, max_candidates=4))
    for key in range(2):
        scorer.open(key, PROBLEMS[key], [])
    scorer.score([(key, STEPS[key][0], []) for key in range(2)])
    for key in range(2):
        scorer.commit(key, STEPS[key][0], [])
    texts = [STEPS[0][1], "A wrong turn: x = 7.\n\n", "x\n\n"]
    got = scorer.score([(0, text, []) for text in texts])
    assert got == pytest.approx(prm_last_scores(prm, PROBLEMS[0], [[STEPS[0][0], t] for t in texts]), abs=1e-4)
    assert {width for _, width, _ in scorer.static.steps} == {scorer.cache.block_table.table.shape[1] + 1}


def test_on_cuda_with_graphs_a_step_of_known_buckets_replays_its_scoring_rather_than_dispatching_it() -> None:
    """On a (fake) CUDA device with graphs on, the third of three alike steps scores its candidates by replaying a
    graph captured before (its committed steps cost no forward: the winners' rows are kept): a few dozen ops
    dispatched for the buffers and the scores, whatever the layers, where the eager scorer dispatches each layer's forward again; with batch invariance
    on (`--deterministic`) the scorer keeps the eager path."""
    import kvrescue.engine.invariance as invariance
    from kvrescue_testkit.dry_run import fake_model
    from kvrescue_testkit.fake_cuda import FakeCuda
    from kvrescue_testkit.paper_shapes import SMALL

    tokenizer = build_tokenizer(512)
    dispatched = {}
    with FakeCuda():
        prm = fake_model({**SMALL, "num_hidden_layers": 8}, "prm", tokenizer, torch.bfloat16, "cuda:0")
        for graphs in (False, True):
            scorer = PRMScorer(prm, max_problems=2, max_candidates=8, cuda_graphs=graphs)
            assert (scorer.static is not None) == graphs
            for key in range(2):
                scorer.open(key, PROBLEMS[key], [])
            for t in range(3):
                requests = [(key, text, []) for key in range(2) for text in ("x = 1.\n\n", "x = 2.\n\n", "y = 3.\n\n")]
                with Dispatched() as counted:
                    scorer.score(requests)
                for key in range(2):
                    scorer.commit(key, "x = 1.\n\n", [])
            dispatched[graphs] = len(counted.ops)
        invariance.enable(True)  # --deterministic: the eager path
        try:
            assert PRMScorer(prm, max_problems=2, max_candidates=8, cuda_graphs=True).static is None
        finally:
            invariance.enable(False)
    assert dispatched[True] < 60 and dispatched[False] > 5 * dispatched[True]  # here: 40, and 522 to 554


@pytest.mark.parametrize("method", ["bon", "kvrescue"])
def test_a_cell_scored_in_static_shapes_decodes_and_scores_as_the_eager_one(qwen2_dir, prm_dir, tmp_path,
                                                                            method) -> None:
    """A whole cell (3 problems, batch 2: a problem opened while another goes on) with the PRM's forwards in static
    shapes commits the same steps with the same scores (2e-5) as with the eager PRM."""
    from kvrescue.cell_runners import CellParts, build_cell
    from kvrescue.decoding import decode_cell
    from kvrescue.group_models import load_roles
    from kvrescue.search import SearchSettings
    from tests.helpers import small_cell, small_grid, sums

    models = {"base": str(qwen2_dir), "helper": str(qwen2_dir), "prm": str(prm_dir)}
    options = small_grid(tmp_path, SearchSettings(batch=2, max_steps=3, max_step_tokens=12, context_cap=256),
                         models=models, methods=[method])
    cell = small_cell(sums(3), method, n=3)
    plan, loaded = options.plan_of(cell), load_roles(options.group_plan(), "cpu")
    traces = {}
    for static in (False, True):
        scorer = PRMScorer(loaded["prm"], max_problems=plan.batch, max_candidates=plan.batch * 2 * plan.n,
                           max_step_tokens=plan.max_step_tokens)
        if static:
            _static(scorer)
        emitted = []
        decode_cell(plan, cell, build_cell(plan, loaded, parts=CellParts(scorer=scorer)),
                    iter(cell.problems.problems), lambda trace, _: emitted.append(trace))
        traces[static] = sorted(emitted, key=lambda trace: trace.idx)
        if static:
            assert scorer.static.steps  # the scoring went through the static forwards
    assert len(traces[True]) == 3 and sum(trace.n_steps for trace in traces[True]) >= 6
    for eager, static in zip(traces[False], traces[True]):
        assert [s.text for s in static.steps] == [s.text for s in eager.steps] and static.output == eager.output
        assert [c.score for step in static.candidates for c in step] == pytest.approx(
            [c.score for step in eager.candidates for c in step], abs=2e-5)
