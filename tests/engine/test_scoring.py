"""helper-loglik: each candidate's mean log-probability under the helper, against a plain forward over the whole
text; computed with bounded logits memory and one wait for the device per call."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from kvrescue.engine import FullCache, load_model, scoring
from kvrescue.engine.runner import Runner
from kvrescue.engine.scoring import HelperLoglik
from tests.engine.test_syncs import counting

pytestmark = pytest.mark.usefixtures("kernel_layouts")  # each test also under CUDA's kernel layouts

PROMPTS = [[5, 6, 7, 8] * 5, [9, 10, 11] * 3]
STEPS = [[40, 41, 42, 43, 44, 45], [50, 51]]  # committed after the first scoring
CANDIDATES = [(0, [12] * 9 + [13] * 20), (0, [14]), (1, [15, 16, 17]), (1, list(range(60, 100))), (0, [18, 19])]


@pytest.fixture(scope="module")
def helper(llama_dir):
    return load_model(llama_dir)


def scorer_for(helper) -> HelperLoglik:
    scorer = HelperLoglik(Runner(helper, FullCache.for_model(helper.net, 1 << 12, max_rows=32)))
    for key, prompt in enumerate(PROMPTS):
        scorer.open(key, "", prompt)
    return scorer


def reference(helper, context: list[int], candidate: list[int]) -> float:
    """The mean log-probability of the candidate's tokens after the context, from one plain forward."""
    ids = torch.tensor([context + candidate])
    with torch.inference_mode():
        logprobs = torch.log_softmax(helper.net(ids)[0].float(), dim=-1)
    return logprobs[len(context) - 1 : -1].gather(1, ids[0, len(context) :, None]).mean().item()


def test_scores_are_the_candidates_mean_log_probabilities(helper):
    scorer = scorer_for(helper)
    contexts = dict(enumerate(PROMPTS))
    for round in range(2):
        got = scorer.score([(key, "", tokens) for key, tokens in CANDIDATES])
        want = [reference(helper, contexts[key], tokens) for key, tokens in CANDIDATES]
        assert got == pytest.approx(want, abs=1e-5), f"round {round}"
        for key, step in enumerate(STEPS):
            scorer.commit(key, "", step)
            contexts[key] = contexts[key] + step
    assert scorer.close(1)[0] == len(PROMPTS[1]) + 2 * (len(STEPS[1]) + 3 + 40)  # committed and scored, twice


class LargestVocabTensor(TorchDispatchMode):
    """The bytes of the largest tensor an operation returns with `vocab` columns (logits or log-probabilities)."""

    def __init__(self, vocab: int) -> None:
        super().__init__()
        self.vocab, self.largest = vocab, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor) and t.dim() and t.shape[-1] == self.vocab:
                self.largest = max(self.largest, t.numel() * t.element_size())
        return out


def test_logits_exist_a_bounded_chunk_at_a_time_and_the_host_waits_once(helper, monkeypatch):
    vocab = helper.net.args.vocab_size
    monkeypatch.setattr(scoring, "LOGITS_BYTES", 8 * 4 * vocab, raising=False)  # 8 positions' fp32 logits at once
    scorer = scorer_for(helper)
    requests = [(key, "", tokens) for key, tokens in CANDIDATES]
    every_position = len(requests) * max(len(t) for _, t in CANDIDATES) * 4 * vocab
    with LargestVocabTensor(vocab) as largest, counting(monkeypatch) as waits:
        got = scorer.score(requests)
    assert largest.largest <= 8 * 4 * vocab < every_position / 20
    assert waits == {"Tensor.cpu": 1}  # `PendingScores.wait` (a `Download` of the scores)
    assert got == pytest.approx([reference(helper, PROMPTS[key], tokens) for key, tokens in CANDIDATES], abs=1e-5)
