"""PRM scores from vLLM's pooling runner equal PRMScorer's (fp32, random PRM), driven through the same scorer
protocol: several problems, multi-step trajectories, several candidates a step, and a window that drops steps."""

import pytest

from kvrescue_cli.engine import load_model
from kvrescue_cli.engine.loader import load_tokenizer
from kvrescue_cli.engine.prm import PRMScorer
from kvrescue_cli.vllm_engine.prm import VLLMPRMScorer
from tests.test_engine_prm import PROBLEMS, STEPS

pytestmark = pytest.mark.vllm

MORE_PROBLEMS = PROBLEMS + ["Find the square root of 144."]
MORE_STEPS = STEPS + [["The square root of 144 is 12, since 12 * 12 = 144.\n\n", "So the answer is \\boxed{12}."]]
DISTRACTORS = ["A wrong turn: x = 7.\n\n", "\n\nWe start over", "Check: 3 * 5 + 5 = 15 + 5 = 20.<|im_end|>"]


def drive(scorer, problems: list[str], steps: list[list[str]]) -> tuple[list[float], list[tuple[int, int]]]:
    """Every problem's candidates (its true step and the distractors) scored in one call per step, then the
    true step committed; returns every score and each problem's (dropped steps, truncations)."""
    scores = []
    for key, problem in enumerate(problems):
        scorer.open(key, problem, [])
    for t in range(max(map(len, steps))):
        live = [k for k in range(len(problems)) if t < len(steps[k])]
        scores += scorer.score([(k, text, []) for k in live for text in [steps[k][t], *DISTRACTORS]])
        for k in live:
            scorer.commit(k, steps[k][t], [])
    dropped = [scorer.inputs.problems[k].kept_from for k in range(len(problems))]
    return scores, [(d, scorer.close(k)[1]) for k, d in enumerate(dropped)]


@pytest.fixture(scope="module")
def prm(vllm_prm_dir):
    return load_model(vllm_prm_dir)


def test_vllm_scores_equal_prm_scorer(prm, vllm_prm, vllm_prm_dir) -> None:
    want, _ = drive(PRMScorer(prm, max_problems=4, max_candidates=16), MORE_PROBLEMS, MORE_STEPS)
    tokenizer, _ = load_tokenizer(vllm_prm_dir)  # read as `--engine vllm` reads it, apart from PRMScorer's model
    got, truncated = drive(VLLMPRMScorer(vllm_prm, tokenizer), MORE_PROBLEMS, MORE_STEPS)
    assert len(got) == len(want) == 4 * (3 + 3 + 2)
    assert max(abs(a - b) for a, b in zip(got, want)) < 1e-4
    assert len({round(s, 4) for s in want}) > len(want) // 2  # the candidates are told apart
    assert truncated == [(0, 0)] * 3


def test_the_window_drops_the_same_steps(prm, vllm_prm) -> None:
    long = [STEPS[0] * 3, STEPS[1] * 3]
    want, want_dropped = drive(PRMScorer(prm, max_problems=2, max_candidates=8, window=120), PROBLEMS, long)
    got, dropped = drive(VLLMPRMScorer(vllm_prm, prm.tokenizer, window=120), PROBLEMS, long)
    assert dropped == want_dropped and all(d > 0 and n > 0 for d, n in dropped)
    assert max(abs(a - b) for a, b in zip(got, want)) < 1e-4
