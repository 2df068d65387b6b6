"""PRM scoring: incremental (cached prefix + suffix) equals from scratch and transformers' Qwen2Model + head."""

import pytest
import torch
from safetensors.torch import load_file
from transformers import Qwen2Model

from kvrescue_cli.engine import load_model
from kvrescue_cli.engine.prm import SYSTEM_PROMPT, PRMScorer, prm_last_scores, prm_scores

pytestmark = pytest.mark.usefixtures("kernel_layouts")  # each test also under CUDA's kernel layouts

PROBLEMS = ["What is 3x + 5 = 20 for x?", "Compute 1 + 2 + 3 + ... + 10."]
STEPS = [
    ["Step 1: 3x = 15.\n\n", "Step 2: Dividing both sides by 3 gives x = 5.\n\n", "The answer is \\boxed{5}.<|im_end|>"],
    ["We compute the sum.\n\n", "1 + 2 + 3 + ... + 10 = 55.\n\n", "Therefore, the final answer is $55$."],
]


@pytest.fixture(scope="module")
def prm(prm_dir):
    return load_model(prm_dir)


def _reference(prm_dir, problem: str, steps: list[str]) -> list[float]:
    """transformers' Qwen2Model + the score head read from the checkpoint, on the model card's input."""
    body = Qwen2Model.from_pretrained(prm_dir, dtype=torch.float32).eval()
    sd = load_file(prm_dir / "model.safetensors")
    tok = load_model(prm_dir).tokenizer
    clean = [s.split("<|im_end|>")[0].split("\n\n")[0] for s in steps]
    messages = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": problem},
                {"role": "assistant", "content": "<extra_0>".join(clean) + "<extra_0>"}]
    ids = torch.tensor([tok.encode(tok.apply_chat_template(messages, tokenize=False), add_special_tokens=False)])
    with torch.no_grad():
        h = body(ids).last_hidden_state[0]
        h = torch.relu(h @ sd["score.0.weight"].T + sd["score.0.bias"]) @ sd["score.2.weight"].T + sd["score.2.bias"]
    probs = torch.softmax(h, -1)[:, 1]
    return probs[ids[0] == tok.convert_tokens_to_ids("<extra_0>")].tolist()


def test_incremental_equals_from_scratch_and_transformers(prm, prm_dir) -> None:
    scorer = PRMScorer(prm, max_problems=4, max_candidates=16)
    for key, problem in enumerate(PROBLEMS):
        scorer.open(key, problem, [])
    for t in range(3):
        # Both problems' candidates in one batch: the true next step and a distractor.
        requests = [(k, text, []) for k in (0, 1) for text in (STEPS[k][t], "A wrong turn: x = 7.\n\n")]
        got = scorer.score(requests)
        for (k, text, _), score in zip(requests, got):
            scratch = prm_scores(prm, PROBLEMS[k], STEPS[k][:t] + [text])[-1]
            assert abs(score - scratch) < 1e-4
            if text == STEPS[k][t]:
                assert abs(score - _reference(prm_dir, PROBLEMS[k], STEPS[k][: t + 1])[-1]) < 1e-4
        for k in (0, 1):
            scorer.commit(k, STEPS[k][t], [])
    for k in (0, 1):
        ref = _reference(prm_dir, PROBLEMS[k], STEPS[k])
        assert max(abs(a - b) for a, b in zip(prm_scores(prm, PROBLEMS[k], STEPS[k]), ref)) < 1e-4
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
    kept = scorer.dropped_steps(0)
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


def test_batched_from_scratch_scores_equal_one_trajectory_at_a_time(prm) -> None:
    trajectories = [STEPS[0][:1], STEPS[0], STEPS[1][:2], ["x\n\n"]]  # different lengths: padded rows
    want = [prm_scores(prm, PROBLEMS[0], steps)[-1] for steps in trajectories]
    assert prm_last_scores(prm, PROBLEMS[0], trajectories) == pytest.approx(want, abs=1e-5)
    assert len(set(want)) == len(want)  # the rows are told apart


def test_opens_and_commits_are_fed_with_the_next_score_in_one_forward(prm, monkeypatch) -> None:
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
    for key in range(3):
        scorer.commit(key, STEPS[key % 2][0], [])
    scorer.close(2)  # its committed step is never fed
    assert forwards == [3, 6]
    requests = [(key, STEPS[key][1], []) for key in range(2)]
    second = scorer.score(requests)
    assert forwards == [3, 6, 2, 2]
    assert first[0] == pytest.approx(prm_scores(prm, PROBLEMS[0], STEPS[0][:1])[-1], abs=1e-4)
    for (key, text, _), score in zip(requests, second):
        assert score == pytest.approx(prm_scores(prm, PROBLEMS[key], [STEPS[key][0], text])[-1], abs=1e-4)
    def ids(text):
        return scorer.inputs.step_ids([text])[0]

    # problem 0: its prompt, two candidates, the committed step, one candidate
    processed = len(scorer.inputs.problems[0].prompt) + 2 * len(ids(STEPS[0][0])) + len(ids("x = 7.\n\n"))
    assert scorer.close(0)[0] == processed + len(ids(STEPS[0][1]))


def test_where_flash_attn_serves_the_prm_it_reads_its_cache_through_the_paged_kernel(prm, monkeypatch,
                                                                                     kernel_layouts) -> None:
    """On a device where flash-attn serves the PRM's tensors, its cache takes flash-attn's block size (the paged
    kernel takes no other) and every forward reads it through flash_attn_with_kvcache (a plain-torch stand-in
    here), the candidates' copied partial blocks too, with the from-scratch scores."""
    from kvrescue_cli.engine import attention, caches
    from tests.test_attention import reference_flash_attn_with_kvcache

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
